"""Near misses of a run id or a destination prefix (``ckptd.store.nearby``): the pure parts."""

from __future__ import annotations

from ckptd.store.nearby import RunHint, close_names, parent_url


def test_close_names_finds_typos_and_longer_or_shorter_forms() -> None:
    names = ["prod", "production-eu", "staging", "run1"]
    assert close_names("pro", names)[:2] == ["prod", "production-eu"]
    assert close_names("stagin", names) == ["staging"]
    assert close_names("rnu1", names) == ["run1"]
    assert close_names("zzz", names) == []
    assert close_names("prod", ["prod"]) == []  # the name itself is no near miss


def test_the_parent_of_a_destination_is_one_segment_up_and_none_at_a_root() -> None:
    assert parent_url("s3://ckpt/pro") == ("s3://ckpt", "pro")
    assert parent_url("gs://ckpt/team/pro") == ("gs://ckpt/team", "pro")
    assert parent_url("az://ckpt/a/b") == ("az://ckpt/a", "b")
    assert parent_url("file:///mnt/ckpt/pro") == ("file:///mnt/ckpt", "pro")
    assert parent_url("s3://ckpt") is None
    assert parent_url("file:///") is None


def test_a_hint_names_the_runs_there_or_the_prefixes_beside_and_nothing_for_a_new_store() -> None:
    there = RunHint("s3://ckpt/prod", "rn1", ("run1", "run2"), ("run1",))
    assert there.message == "s3://ckpt/prod holds run(s) run1, run2 (did you mean 'run1'?)"
    many = RunHint("s3://b/p", "x", tuple(f"r{i}" for i in range(8)))
    assert many.message == "s3://b/p holds run(s) r0, r1, r2, r3, r4 (+3 more)"
    beside = RunHint("s3://ckpt/pro", "run1", beside=("s3://ckpt/prod",))
    assert beside.message == "s3://ckpt/pro holds no run; beside it: s3://ckpt/prod"
    assert RunHint("s3://ckpt/new", "run1").message == ""
    assert RunHint("s3://ckpt/p", "run1", ("run1",)).message == ""  # the run is there
