"""Configuration: defaults, layering, and errors that name the offending key."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

import ckptd.trainer
from ckptd import config
from ckptd.config import (
    ConfigError,
    Settings,
    load_settings,
    loading,
    render_effective_config,
    require_destination,
    require_watch,
)
from ckptd.core.handoff import TRAINER_VARIABLES


def write(tmp_path: Path, text: str, name: str = "ckptd.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load(tmp_path: Path, text: str = "", **kwargs: Any) -> Settings:
    """Load ``text`` as the config file, with an empty environment unless one is given."""
    kwargs.setdefault("environ", {})
    return load_settings(write(tmp_path, text), **kwargs)


def error_of(tmp_path: Path, text: str = "", **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text, **kwargs)
    return caught.value


# --- defaults ----------------------------------------------------------------------------


def test_defaults_are_those_the_configuration_reference_shows(tmp_path: Path) -> None:
    settings = load(tmp_path)
    assert settings == Settings()
    assert settings.watch == []
    d = settings.destination
    assert (d.url, d.endpoint_url, d.region) == ("", "", "")
    assert (d.part_size_mib, d.concurrency, d.max_upload_mib_per_s, d.max_attempts) == (
        64,
        8,
        0,
        8,
    )
    r = settings.retention
    assert (r.keep_last, r.keep_every_steps, r.local_keep_last) == (5, 0, 0)
    p = settings.preemption
    assert (p.provider, p.endpoint, p.poll_interval_seconds, p.imdsv1_fallback) == (
        "auto",
        "",
        1.0,
        False,
    )
    t = settings.trainer
    assert (t.pidfile, t.match, t.signal) == ("", "", "SIGUSR1")
    assert settings.metrics.listen == "127.0.0.1:9464"
    assert settings.http.token.get_secret_value() == ""
    assert settings.state.dir == Path("/var/lib/ckptd")
    assert str(config.DEFAULT_CONFIG_PATH) == "/etc/ckptd/ckptd.toml"


def test_watch_entry_defaults_are_those_the_configuration_reference_shows(tmp_path: Path) -> None:
    (watch,) = load(tmp_path, '[[watch]]\ndir = "/data/ckpt/run1"\n').watch
    assert watch.dir == Path("/data/ckpt/run1")
    assert watch.run_id is None
    assert watch.effective_run_id == "run1"
    assert (watch.layout, watch.quiescence_seconds, watch.settle_seconds) == ("auto", 10, 2)
    assert (watch.marker, watch.rescan_seconds) == ("COMPLETE", 30)


def test_the_original_contracts_example_config_loads(tmp_path: Path) -> None:
    settings = load(
        tmp_path,
        """
        [[watch]]
        dir = "/data/ckpt/run1"
        run_id = "run1"
        layout = "auto"
        quiescence_seconds = 10

        [destination]
        url = "s3://bucket/prefix"
        endpoint_url = ""
        region = ""
        part_size_mib = 64
        concurrency = 8
        max_upload_mib_per_s = 0

        [retention]
        keep_last = 5
        keep_every_steps = 0
        local_keep_last = 0

        [preemption]
        provider = "auto"
        endpoint = ""
        poll_interval_seconds = 1.0

        [trainer]
        pidfile = ""
        match = ""
        signal = "SIGUSR1"

        [metrics]
        listen = "127.0.0.1:9464"

        [state]
        dir = "/var/lib/ckptd"
        """,
    )
    assert settings.watch[0].effective_run_id == "run1"
    assert settings.destination.url == "s3://bucket/prefix"


def test_settings_alone_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_DESTINATION__URL", "s3://from-env")
    assert Settings().destination.url == ""


def test_default_config_path_is_read_when_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, '[destination]\nurl = "s3://default-file"\n')
    monkeypatch.setattr(loading, "DEFAULT_CONFIG_PATH", path)
    assert load_settings(environ={}).destination.url == "s3://default-file"


def test_absent_default_config_path_means_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loading, "DEFAULT_CONFIG_PATH", tmp_path / "absent.toml")
    assert load_settings(environ={}) == Settings()


# --- every key's bad value is reported under that key ------------------------------------

BAD_VALUES = [
    # (TOML, key)
    ('[[watch]]\ndir = "relative/dir"', "watch[0].dir"),
    ("[[watch]]\ndir = 5", "watch[0].dir"),
    ('[[watch]]\ndir = "/d/r"\nrun_id = "has space"', "watch[0].run_id"),
    ('[[watch]]\ndir = "/d/r"\nrun_id = "a..b"', "watch[0].run_id"),
    ('[[watch]]\ndir = "/d/r"\nrun_id = ""', "watch[0].run_id"),
    ('[[watch]]\ndir = "/d/r"\nrun_id = "a/b"', "watch[0].run_id"),
    ('[[watch]]\ndir = "/d/r"\nlayout = "keras"', "watch[0].layout"),
    ('[[watch]]\ndir = "/d/r"\nquiescence_seconds = 0', "watch[0].quiescence_seconds"),
    ('[[watch]]\ndir = "/d/r"\nquiescence_seconds = inf', "watch[0].quiescence_seconds"),
    ('[[watch]]\ndir = "/d/r"\nsettle_seconds = -1', "watch[0].settle_seconds"),
    ('[[watch]]\ndir = "/d/r"\nmarker = "a/b"', "watch[0].marker"),
    ('[[watch]]\ndir = "/d/r"\nmarker = ""', "watch[0].marker"),
    ('[[watch]]\ndir = "/d/r"\nrescan_seconds = 0', "watch[0].rescan_seconds"),
    ('[[watch]]\ndir = "/d/r"\nship_early = "maybe"', "watch[0].ship_early"),
    ('[destination]\nurl = "ftp://bucket"', "destination.url"),
    ('[destination]\nurl = "s3://Upper_Case"', "destination.url"),
    ('[destination]\nurl = "s3://ab"', "destination.url"),
    ('[destination]\nurl = "s3://192.168.1.1"', "destination.url"),
    ('[destination]\nurl = "s3://bucket/a/../b"', "destination.url"),
    ('[destination]\nurl = "s3://bucket/a//b"', "destination.url"),
    ('[destination]\nurl = "file://relative/path"', "destination.url"),
    ('[destination]\nendpoint_url = "ftp://host"', "destination.endpoint_url"),
    ('[destination]\nendpoint_url = "http://host/path"', "destination.endpoint_url"),
    ('[destination]\nendpoint_url = "http://host:99999"', "destination.endpoint_url"),
    ("[destination]\nregion = 5", "destination.region"),
    ("[destination]\npart_size_mib = 4", "destination.part_size_mib"),
    ("[destination]\npart_size_mib = 5121", "destination.part_size_mib"),
    ("[destination]\npart_size_mib = 6.5", "destination.part_size_mib"),
    ("[destination]\nconcurrency = 0", "destination.concurrency"),
    ("[destination]\nconcurrency = 65", "destination.concurrency"),
    ("[destination]\nmax_upload_mib_per_s = -1", "destination.max_upload_mib_per_s"),
    ("[destination]\nmax_attempts = 0", "destination.max_attempts"),
    ("[destination]\nmax_attempts = 101", "destination.max_attempts"),
    ('[destination]\nsse = "SSE-C"', "destination.sse"),
    ('[destination]\nurl = "file:///mnt/c"\nsse = "AES256"', "destination.sse"),
    ('[destination]\nsse = "AES256"\nsse_kms_key_id = "k"', "destination.sse_kms_key_id"),
    ('[destination]\nurl = "gs://b-1/x"\nsse = "aws:kms"', "destination.sse"),
    ('[destination]\nurl = "gs://B/x"', "destination.url"),
    ('[authentication]\nkey_file = "relative.key"', "authentication.key_file"),
    ('[authentication]\nkey_file = "/nonexistent/ckptd.key"', "authentication.key_file"),
    ('[authentication]\nverify_key_files = "/etc/old.key"', "authentication.verify_key_files"),
    (
        '[authentication]\nverify_key_files = ["/nonexistent/old.key"]',
        "authentication.verify_key_files[0]",
    ),
    ("[retention]\nkeep_last = -1", "retention.keep_last"),
    ("[retention]\nkeep_every_steps = -1", "retention.keep_every_steps"),
    ("[retention]\nlocal_keep_last = -1", "retention.local_keep_last"),
    ('[retention]\nkeep_within = "7 days"', "retention.keep_within"),
    ('[retention]\nkeep_within = "-1d"', "retention.keep_within"),
    ('[destination]\nname = "has space"', "destination.name"),
    ('[destination]\nname = "1st"', "destination.name"),
    ('[[tiers]]\nname = "s3"', "tiers[0].url"),
    ('[[tiers]]\nurl = "file:///t"', "tiers[0].name"),
    ('[[tiers]]\nname = "s3"\nurl = ""', "tiers[0].url"),
    ('[[tiers]]\nname = "s3"\nurl = "ftp://h/p"', "tiers[0].url"),
    ('[[tiers]]\nname = "s3"\nurl = "s3://bkt"\nendpoint_url = "ftp://h"', "tiers[0].endpoint_url"),
    ('[[tiers]]\nname = "s3"\nurl = "s3://bkt"\nregion = 5', "tiers[0].region"),
    ('[[tiers]]\nname = "s3"\nurl = "s3://bkt"\npart_size_mib = 1', "tiers[0].part_size_mib"),
    ('[[tiers]]\nname = "s3"\nurl = "s3://bkt"\nconcurrency = 0', "tiers[0].concurrency"),
    (
        '[[tiers]]\nname = "s3"\nurl = "s3://bkt"\nmax_upload_mib_per_s = -1',
        "tiers[0].max_upload_mib_per_s",
    ),
    ('[[tiers]]\nname = "s3"\nurl = "s3://bkt"\nmax_attempts = 0', "tiers[0].max_attempts"),
    ('[[tiers]]\nname = "s3"\nurl = "s3://bkt"\nsse = "DES"', "tiers[0].sse"),
    ('[[tiers]]\nname = "s3"\nurl = "s3://bkt"\nsse_kms_key_id = "k"', "tiers[0].sse_kms_key_id"),
    ('[[tiers]]\nname = "nfs"\nurl = "file:///t"\nsse = "AES256"', "tiers[0].sse"),
    ('[[tiers]]\nname = "s3"\nurl = "s3://bkt"\nretention = 5', "tiers[0].retention"),
    (
        '[[tiers]]\nname = "s3"\nurl = "s3://bkt"\n[tiers.retention]\nkeep_within = "x"',
        "tiers[0].retention.keep_within",
    ),
    (
        '[[tiers]]\nname = "s3"\nurl = "s3://bkt"\n[tiers.retention]\nlocal_keep_last = 1',
        "tiers[0].retention.local_keep_last",
    ),
    ('[destination]\nname = "a"\n[[tiers]]\nname = "a"\nurl = "file:///t"', "tiers[0].name"),
    (
        '[destination]\nurl = "file:///t"\n[[tiers]]\nname = "b"\nurl = "file:///t"',
        "tiers[0].url",
    ),
    ('[cluster]\nnodes = 2\nnode_rank = 0\n[[tiers]]\nname = "b"\nurl = "file:///t"', "tiers"),
    ('[preemption]\nprovider = "oracle"', "preemption.provider"),
    ('[preemption]\nendpoint = "169.254.169.254"', "preemption.endpoint"),
    ("[preemption]\npoll_interval_seconds = 0", "preemption.poll_interval_seconds"),
    ("[preemption]\npoll_interval_seconds = 61", "preemption.poll_interval_seconds"),
    ('[preemption]\nimdsv1_fallback = "maybe"', "preemption.imdsv1_fallback"),
    ('[preemption]\nsigterm = "restart"', "preemption.sigterm"),
    ('[trainer]\npidfile = "train.pid"', "trainer.pidfile"),
    ("[trainer]\nmatch = 5", "trainer.match"),
    ('[trainer]\nsignal = "SIGNOPE"', "trainer.signal"),
    ('[trainer]\nsignal = "SIGKILL"', "trainer.signal"),
    ('[trainer]\npidfile = "/run/t.pid"\nmatch = "train.py"', "trainer.match"),
    ("[resources]\nnice = -1", "resources.nice"),
    ("[resources]\nnice = 20", "resources.nice"),
    ('[resources]\nio_class = "realtime"', "resources.io_class"),
    ("[resources]\nio_priority = 8", "resources.io_priority"),
    ('[resources]\ndrop_page_cache = "sometimes"', "resources.drop_page_cache"),
    ('[resources]\ncpu_policy = "fifo"', "resources.cpu_policy"),
    ('[metrics]\nlisten = "9464"', "metrics.listen"),
    ('[metrics]\nlisten = "127.0.0.1:65536"', "metrics.listen"),
    ('[metrics]\nlisten = "::1:9464"', "metrics.listen"),
    ('[metrics]\nlisten = "[nope]:9464"', "metrics.listen"),
    ("[http]\ntoken = 5", "http.token"),
    ('[http]\nlisten = "unix:relative.sock"', "http.listen"),
    ('[http]\nlisten = "0.0.0.0:9465"', "http.listen"),  # reachable, and no token
    ('[http]\ntoken_file = "token"', "http.token_file"),
    ('[http]\ntoken = "a"\ntoken_file = "/run/secrets/token"', "http.token_file"),
    ('[state]\ndir = "relative"', "state.dir"),
    ("[cluster]\nnodes = 0", "cluster.nodes"),
    ("[cluster]\nnodes = 2\nnode_rank = 2", "cluster.node_rank"),
    ("[cluster]\nnode_rank = -1", "cluster.node_rank"),
    ("[cluster]\nnodes = 2", "cluster.node_rank"),
    ('[cluster]\nnodes = 2\nnode_rank = 0\njob_id = ""', "cluster.job_id"),
    ("[cluster]\npoll_interval_seconds = 0", "cluster.poll_interval_seconds"),
    ("[cadence]\nmtbf_hours = -1", "cadence.mtbf_hours"),
    ("[cadence]\nmerge_seconds = -1", "cadence.merge_seconds"),
    ('[cadence]\nlearn_from_other_runs = "maybe"', "cadence.learn_from_other_runs"),
    ("[cadence]\nprior_mtbf_hours = 0", "cadence.prior_mtbf_hours"),
    ("[cadence]\nmin_interval_seconds = -5", "cadence.min_interval_seconds"),
    (
        "[cadence]\nmin_interval_seconds = 900\nmax_interval_seconds = 600",
        "cadence.min_interval_seconds",
    ),
    ("[cadence]\nmax_interval_seconds = 0", "cadence.max_interval_seconds"),
    ('[slurm]\nenabled = "on"', "slurm.enabled"),
    ("[slurm]\nlead_seconds = -1", "slurm.lead_seconds"),
    ("[slurm]\nlead_margin_seconds = -1", "slurm.lead_margin_seconds"),
    ("[slurm]\npoll_interval_seconds = 0", "slurm.poll_interval_seconds"),
    ("[slurm]\ngrace_seconds = -1", "slurm.grace_seconds"),
    ('[slurm]\nsignal = "SIGTERM"', "slurm.signal"),
    ('[slurm]\nsignal = "SIGNOPE"', "slurm.signal"),
    ('[slurm]\nrequeue = "sometimes"', "slurm.requeue"),
    ('[drill]\nevery = "weekly"', "drill.every"),
    ("[drill]\njitter = 1", "drill.jitter"),
    ("[drill]\nmargin_seconds = -1", "drill.margin_seconds"),
    ("[drill]\ndeadline_seconds = 0", "drill.deadline_seconds"),
    ("[drill]\nmax_wait_seconds = -1", "drill.max_wait_seconds"),
    ('[drill]\nresume = "python train.py"', "drill.resume"),
    ("[drill]\nresume_steps = -1", "drill.resume_steps"),
    ("[drill]\nresume_timeout_seconds = 0", "drill.resume_timeout_seconds"),
    ('[drill]\ncheck = "python check.py"', "drill.check"),
    ('[drill]\ncheck = [" ", "check.py"]', "drill.check"),
    ("[drill]\ncheck_timeout_seconds = 0", "drill.check_timeout_seconds"),
    ('[drill]\nscratch_dir = "scratch"', "drill.scratch_dir"),
    ("[drill]\nhistory = 0", "drill.history"),
    ('[peers]\nenabled = "yes please"', "peers.enabled"),
    (
        '[cluster]\nnodes = 1\n[peers]\nenabled = true\ntoken_file = "/t"\nquota_gib = 1',
        "peers.enabled",
    ),
    ('[peers]\nlisten = "nowhere"', "peers.listen"),
    ('[peers]\nadvertise = "bad host!"', "peers.advertise"),
    ('[peers]\ntoken_file = "relative/token"', "peers.token_file"),
    (
        "[cluster]\nnodes = 2\nnode_rank = 0\n[peers]\nenabled = true\nquota_gib = 1",
        "peers.token_file",
    ),
    ('[peers]\ndir = "relative"', "peers.dir"),
    (
        '[[watch]]\ndir = "/d/r"\n[state]\ndir = "/s"\n[cluster]\nnodes = 2\nnode_rank = 0\n'
        '[peers]\nenabled = true\ntoken_file = "/t"\nquota_gib = 1\ndir = "/d/r/replicas"',
        "peers.dir",
    ),
    ("[peers]\nquota_gib = -1", "peers.quota_gib"),
    (
        '[cluster]\nnodes = 2\nnode_rank = 0\n[peers]\nenabled = true\ntoken_file = "/t"',
        "peers.quota_gib",
    ),
    ("[peers]\ncopies = 0", "peers.copies"),
    ("[peers]\ncopies = 9", "peers.copies"),
    ('[peers]\nperiodic = "often"', "peers.periodic"),
    ('[peers]\nshare_restores = "yes please"', "peers.share_restores"),
    ("[peers]\nshare_port = 70000", "peers.share_port"),
    ('[peers]\nlisten = "0.0.0.0:9500"\nshare_port = 9500', "peers.share_port"),
    ("[peers]\nrate_mbit = -1", "peers.rate_mbit"),
    ("[peers]\nemergency_rate_mbit = -1", "peers.emergency_rate_mbit"),
    ("[peers]\nfailure_domain = 5", "peers.failure_domain"),
    ("[peers]\nhandoff_after_seconds = 0", "peers.handoff_after_seconds"),
    ("[peers]\nrestore_wait_seconds = 31", "peers.restore_wait_seconds"),
    ("[peers]\nannounce_interval_seconds = 0", "peers.announce_interval_seconds"),
    ('[health]\nenabled = "sometimes"', "health.enabled"),
    ("[health]\npoll_interval_seconds = 0", "health.poll_interval_seconds"),
    ('[health]\nkmsg = "dev/kmsg"', "health.kmsg"),
    ('[health]\npsi = "proc/pressure/memory"', "health.psi"),
    ('[health]\ncgroup = "sys/fs/cgroup/train"', "health.cgroup"),
    ('[health]\ndcgm_url = "localhost:9400"', "health.dcgm_url"),
    ('[health]\nnvml = "when there is one"', "health.nvml"),
    ("[health]\ngpu_temperature_celsius = 200", "health.gpu_temperature_celsius"),
    ("[health]\ngpu_corrected_ecc_per_minute = -1", "health.gpu_corrected_ecc_per_minute"),
    ("[health]\nmemory_full_avg10_percent = 0", "health.memory_full_avg10_percent"),
    ("[health]\nmemory_use_ratio = 1.5", "health.memory_use_ratio"),
    ("[health]\ndisk_free_factor = 0.5", "health.disk_free_factor"),
    ("[health]\nunreachable_seconds = 0", "health.unreachable_seconds"),
    ("[health]\nsave_interval_seconds = -1", "health.save_interval_seconds"),
    ("[health]\nsave_timeout_seconds = 0", "health.save_timeout_seconds"),
    ('[health]\non_degrading = "reboot"', "health.on_degrading"),
    ('[health]\non_fatal = "panic"', "health.on_fatal"),
    ('[health]\non_warning = "ignore"', "health.on_warning"),
    ('[health]\ncondition_file = "relative.json"', "health.condition_file"),
    ("[health]\nloss_window = 1", "health.loss_window"),
    ("[health]\nloss_z = 0", "health.loss_z"),
    ("[health]\nloss_min_reports = 60", "health.loss_min_reports"),
    ("[health]\nprotect_hours = -1", "health.protect_hours"),
    ('destination = "s3://bucket"', "destination"),
    ('[[watch]]\ndir = "/d/r"\n[[watch]]\ndir = "/e/r"', "watch[1].run_id"),
]


@pytest.mark.parametrize(("toml", "key"), BAD_VALUES, ids=[key for _, key in BAD_VALUES])
def test_bad_value_is_reported_under_its_key(tmp_path: Path, toml: str, key: str) -> None:
    err = error_of(tmp_path, toml)
    assert err.key == key
    assert str(err).startswith(f"invalid config: {key}: ")


def test_every_key_has_a_bad_value_case() -> None:
    covered = {
        key.replace("[0]", "") if key.startswith("tiers") else key.split("].")[-1]
        for _, key in BAD_VALUES
    }
    lists = {"watch": config.WatchConfig, "tiers": config.TierConfig}
    for section, field in Settings.model_fields.items():
        model = lists.get(section, field.annotation)
        assert isinstance(model, type)
        for name in model.model_fields:
            wanted = name if section == "watch" else f"{section}.{name}"
            assert wanted in covered, f"no bad-value test for {wanted}"


@pytest.mark.parametrize(
    "endpoint",
    [
        "https://storage.googleapis.com",
        "https://storage.googleapis.com:443",
        "https://storage.googleapis.com.",  # the trailing dot of a fully qualified name
        "https://STORAGE.GoogleAPIs.com",
        "https://my-bucket.storage.googleapis.com",
    ],
)
def test_an_s3_destination_at_googles_endpoint_is_refused_pointing_to_gs(
    tmp_path: Path, endpoint: str
) -> None:
    err = error_of(tmp_path, f'[destination]\nurl = "s3://b-1/x"\nendpoint_url = "{endpoint}"')
    assert err.key == "destination.endpoint_url"
    assert "gs://" in str(err) and "\n" not in str(err)


def test_a_gs_destination_takes_a_cloud_kms_key_alone(tmp_path: Path) -> None:
    key = "projects/p/locations/l/keyRings/r/cryptoKeys/k"
    dest = config.DestinationConfig(url="gs://b_1/x", sse_kms_key_id=key)
    assert (dest.kind, dest.bucket, dest.prefix) == ("gs", "b_1", "x")


def test_message_says_what_is_wrong_and_what_was_given(tmp_path: Path) -> None:
    err = error_of(tmp_path, "[destination]\npart_size_mib = 1\n")
    assert str(err) == "invalid config: destination.part_size_mib: must be >= 5 (got 1)"
    assert err.key == "destination.part_size_mib"


def test_every_problem_is_reported_and_the_first_is_the_key(tmp_path: Path) -> None:
    err = error_of(
        tmp_path,
        """
        [destination]
        concurrency = 0
        max_attempts = 0
        [metrics]
        listen = "nope"
        """,
    )
    assert err.key == "destination.concurrency"
    assert [p.key for p in err.problems] == [
        "destination.concurrency",
        "destination.max_attempts",
        "metrics.listen",
    ]
    assert len(str(err).splitlines()) == 3


def test_duplicate_run_id_is_reported_on_the_second_entry(tmp_path: Path) -> None:
    err = error_of(
        tmp_path,
        """
        [[watch]]
        dir = "/data/a"
        run_id = "run1"
        [[watch]]
        dir = "/data/b"
        run_id = "run1"
        """,
    )
    assert err.key == "watch[1].run_id"
    assert "'run1'" in err.message and "watch[0]" in err.message


def test_same_dir_watched_twice_is_an_error(tmp_path: Path) -> None:
    err = error_of(
        tmp_path,
        '[[watch]]\ndir = "/data/a"\nrun_id = "x"\n[[watch]]\ndir = "/data/a/"\nrun_id = "y"\n',
    )
    assert err.key == "watch[1].dir"


def test_unusable_basename_as_default_run_id_is_reported_on_run_id(tmp_path: Path) -> None:
    err = error_of(tmp_path, '[[watch]]\ndir = "/data/my run"\n')
    assert err.key == "watch[0].run_id"
    assert "'my run'" in err.message


def test_explicit_run_id_rescues_an_unusable_basename(tmp_path: Path) -> None:
    (watch,) = load(tmp_path, '[[watch]]\ndir = "/data/my run"\nrun_id = "my-run"\n').watch
    assert watch.effective_run_id == "my-run"


# --- unknown keys ------------------------------------------------------------------------


def test_unknown_key_in_a_section_is_an_error(tmp_path: Path) -> None:
    err = error_of(tmp_path, "[destination]\npart_size = 64\n")
    assert err.key == "destination.part_size"
    assert "unknown key" in err.message and "part_size_mib" in err.message


def test_unknown_key_in_a_watch_entry_is_an_error(tmp_path: Path) -> None:
    err = error_of(tmp_path, '[[watch]]\ndir = "/d/r"\nlayuot = "hf"\n')
    assert err.key == "watch[0].layuot"


def test_unknown_top_level_section_is_an_error(tmp_path: Path) -> None:
    err = error_of(tmp_path, '[destinaton]\nurl = "s3://bucket"\n')
    assert err.key == "destinaton"
    assert "did you mean 'destination'" in err.message


def test_unknown_top_level_key_never_reaches_basesettings_options(tmp_path: Path) -> None:
    # BaseSettings.__init__ treats _-prefixed keywords as options (_cli_parse_args would
    # parse sys.argv); from a config file such a key is just unknown.
    err = error_of(tmp_path, "_cli_parse_args = true\n")
    assert err.key == "_cli_parse_args"


def test_top_level_keys_are_case_sensitive(tmp_path: Path) -> None:
    assert error_of(tmp_path, '[DESTINATION]\nurl = "s3://bucket"\n').key == "DESTINATION"


def test_unknown_ckptd_env_var_is_an_error_naming_it(tmp_path: Path) -> None:
    err = error_of(tmp_path, environ={"CKPTD_DESTINATION__ULR": "s3://bucket"})
    assert err.key == "CKPTD_DESTINATION__ULR"
    assert "CKPTD_DESTINATION__URL" in err.message


def test_unknown_top_level_ckptd_env_var_is_an_error(tmp_path: Path) -> None:
    assert error_of(tmp_path, environ={"CKPTD_BOGUS": "1"}).key == "CKPTD_BOGUS"


def test_watch_cannot_be_set_key_by_key_from_env(tmp_path: Path) -> None:
    err = error_of(tmp_path, environ={"CKPTD_WATCH__0__DIR": "/data"})
    assert err.key == "CKPTD_WATCH__0__DIR"
    assert "JSON list" in err.message


def test_other_env_vars_are_ignored(tmp_path: Path) -> None:
    assert load(tmp_path, environ={"PATH": "/bin", "CKPT_X": "1"}) == Settings()


def test_the_trainer_helpers_variables_are_passed_by(tmp_path: Path) -> None:
    # Set for (or by) the trainer: `CKPTD_STEP_REPORT_SECONDS=1 ckptd exec -- ...` once
    # exited 2 as an unknown setting.
    trainer_side = {name: "1" for name in TRAINER_VARIABLES}
    assert load(tmp_path, environ=trainer_side) == Settings()


def test_every_variable_the_trainer_helpers_read_is_named_as_theirs() -> None:
    read = set()
    for module in (Path(ckptd.trainer.__file__).parent).glob("*.py"):
        read |= set(re.findall(r"[\"'](CKPTD_[A-Z0-9_]+)[\"']", module.read_text()))
    assert read and read <= TRAINER_VARIABLES, sorted(read - TRAINER_VARIABLES)


# --- layering ----------------------------------------------------------------------------


def test_env_overrides_toml_and_keeps_the_rest_of_the_section(tmp_path: Path) -> None:
    settings = load(
        tmp_path,
        '[destination]\nurl = "s3://from-file"\nconcurrency = 3\n',
        environ={"CKPTD_DESTINATION__URL": "s3://from-env"},
    )
    assert settings.destination.url == "s3://from-env"
    assert settings.destination.concurrency == 3


def test_env_var_names_are_case_insensitive(tmp_path: Path) -> None:
    settings = load(tmp_path, environ={"ckptd_destination__url": "s3://lower"})
    assert settings.destination.url == "s3://lower"


def test_overrides_beat_env_and_toml(tmp_path: Path) -> None:
    settings = load(
        tmp_path,
        '[destination]\nurl = "s3://from-file"\nregion = "eu-west-1"\n',
        environ={"CKPTD_DESTINATION__URL": "s3://from-env"},
        overrides={"destination": {"url": "s3://from-flag"}},
    )
    assert settings.destination.url == "s3://from-flag"
    assert settings.destination.region == "eu-west-1"


def test_none_in_overrides_means_flag_not_given(tmp_path: Path) -> None:
    settings = load(
        tmp_path,
        environ={"CKPTD_DESTINATION__URL": "s3://from-env"},
        overrides={"destination": {"url": None, "endpoint_url": None}, "watch": None},
    )
    assert settings.destination.url == "s3://from-env"


def test_watch_override_replaces_the_file_list(tmp_path: Path) -> None:
    settings = load(
        tmp_path,
        '[[watch]]\ndir = "/a/one"\n[[watch]]\ndir = "/a/two"\n',
        overrides={"watch": [{"dir": "/b/three"}]},
    )
    assert [w.effective_run_id for w in settings.watch] == ["three"]


def test_watch_list_from_env_json(tmp_path: Path) -> None:
    settings = load(tmp_path, environ={"CKPTD_WATCH": '[{"dir": "/x/run9", "layout": "hf"}]'})
    assert settings.watch[0].dir == Path("/x/run9")
    assert settings.watch[0].layout == "hf"


def test_section_from_env_json(tmp_path: Path) -> None:
    settings = load(tmp_path, environ={"CKPTD_RETENTION": '{"keep_last": 2}'})
    assert settings.retention.keep_last == 2


def test_bad_json_in_env_names_the_variable(tmp_path: Path) -> None:
    err = error_of(tmp_path, environ={"CKPTD_WATCH": "/data/ckpt"})
    assert err.key == "CKPTD_WATCH"
    assert "JSON" in err.message


def test_bad_env_value_names_key_and_variable(tmp_path: Path) -> None:
    err = error_of(tmp_path, environ={"CKPTD_DESTINATION__PART_SIZE_MIB": "1"})
    assert err.key == "destination.part_size_mib"
    assert "CKPTD_DESTINATION__PART_SIZE_MIB" in str(err)


def test_bad_file_value_is_not_blamed_on_env(tmp_path: Path) -> None:
    err = error_of(
        tmp_path,
        "[destination]\npart_size_mib = 1\n",
        environ={"CKPTD_DESTINATION__URL": "s3://bucket"},
    )
    assert "CKPTD_" not in str(err)


def test_environ_defaults_to_process_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTD_DESTINATION__REGION", "ap-south-1")
    settings = load_settings(write(tmp_path, ""))
    assert settings.destination.region == "ap-south-1"


def test_unknown_override_key_is_an_error(tmp_path: Path) -> None:
    err = error_of(tmp_path, overrides={"destination": {"dst": "s3://bucket"}})
    assert err.key == "destination.dst"


# --- the config file itself --------------------------------------------------------------


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[destination]\nurl = "s3://bucket"\nconcurrency = = 3\n')
    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ={})
    assert caught.value.key == str(path)
    assert f"{path}: line 3" in str(caught.value)
    assert "TOML syntax error" in str(caught.value)


def test_toml_error_at_end_of_file_still_names_a_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[destination]\nurl = "s3://bucket\n')
    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ={})
    assert caught.value.key == str(path)
    assert ": line " in str(caught.value)


def test_missing_explicit_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(tmp_path / "nope.toml", environ={})
    assert caught.value.key == str(tmp_path / "nope.toml")
    assert "does not exist" in str(caught.value)


def test_directory_as_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(tmp_path, environ={})
    assert caught.value.key == str(tmp_path)


def test_non_utf8_config_file_is_an_error_with_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(b'[destination]\nregion = "\xff"\n')
    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ={})
    assert caught.value.key == str(path)
    assert "line 2" in str(caught.value)


# --- derived values ----------------------------------------------------------------------


def test_watch_dir_expands_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/home/trainer")
    (watch,) = load(tmp_path, '[[watch]]\ndir = "~/ckpt/run7"\n').watch
    assert watch.dir == Path("/home/trainer/ckpt/run7")
    assert watch.effective_run_id == "run7"


def test_s3_destination_parts(tmp_path: Path) -> None:
    dest = load(tmp_path, '[destination]\nurl = "s3://my-bucket/team/ckpt/"\n').destination
    assert (dest.kind, dest.bucket, dest.prefix) == ("s3", "my-bucket", "team/ckpt")
    with pytest.raises(ValueError):
        _ = dest.root_path


def test_s3_destination_without_prefix(tmp_path: Path) -> None:
    dest = load(tmp_path, '[destination]\nurl = "s3://my-bucket"\n').destination
    assert (dest.bucket, dest.prefix) == ("my-bucket", "")


def test_file_destination_parts(tmp_path: Path) -> None:
    dest = load(tmp_path, '[destination]\nurl = "file:///mnt/shared/ckpt"\n').destination
    assert (dest.kind, dest.root_path) == ("file", Path("/mnt/shared/ckpt"))
    with pytest.raises(ValueError):
        _ = dest.bucket


def test_unset_destination_is_an_error_only_where_needed() -> None:
    settings = Settings()
    with pytest.raises(ConfigError) as caught:
        require_destination(settings)
    assert caught.value.key == "destination.url"
    with pytest.raises(ConfigError):
        _ = settings.destination.kind


def test_require_destination_accepts_a_set_url(tmp_path: Path) -> None:
    require_destination(load(tmp_path, environ={"CKPTD_DESTINATION__URL": "file:///srv"}))


def test_require_watch_names_watch() -> None:
    with pytest.raises(ConfigError) as caught:
        require_watch(Settings())
    assert caught.value.key == "watch"


@pytest.mark.parametrize(
    ("listen", "host", "port"),
    [("127.0.0.1:9464", "127.0.0.1", 9464), ("[::1]:0", "::1", 0), ("node-1:80", "node-1", 80)],
)
def test_metrics_listen_parts(tmp_path: Path, listen: str, host: str, port: int) -> None:
    metrics = load(tmp_path, f'[metrics]\nlisten = "{listen}"\n').metrics
    assert (metrics.host, metrics.port) == (host, port)


def test_signal_name_is_normalised(tmp_path: Path) -> None:
    trainer = load(tmp_path, '[trainer]\nsignal = "usr2"\n').trainer
    assert trainer.signal == "SIGUSR2"
    assert trainer.signal_number.name == "SIGUSR2"


def test_endpoint_url_accepts_host_and_port(tmp_path: Path) -> None:
    settings = load(tmp_path, '[destination]\nendpoint_url = "http://[::1]:8333"\n')
    assert settings.destination.endpoint_url == "http://[::1]:8333"


# --- secrets -----------------------------------------------------------------------------


def test_credentials_in_a_url_are_not_echoed(tmp_path: Path) -> None:
    err = error_of(tmp_path, '[destination]\nendpoint_url = "http://AKIA:hunter2@host:9000"\n')
    assert err.key == "destination.endpoint_url"
    assert "hunter2" not in str(err)


def test_bad_token_value_is_not_echoed(tmp_path: Path) -> None:
    err = error_of(tmp_path, environ={"CKPTD_HTTP": '{"token": 123456789}'})
    assert err.key == "http.token"
    assert "123456789" not in str(err)


def test_secret_is_not_in_rendered_text_or_repr(tmp_path: Path) -> None:
    settings = load(tmp_path, environ={"CKPTD_HTTP__TOKEN": "s3cr3t-t0ken"})
    assert settings.http.token.get_secret_value() == "s3cr3t-t0ken"
    rendered = render_effective_config(settings)
    assert "s3cr3t-t0ken" not in rendered
    assert 'token = "***"' in rendered
    assert "s3cr3t-t0ken" not in repr(settings)


def test_unset_token_renders_empty_not_masked() -> None:
    assert 'token = ""' in render_effective_config(Settings())


# --- rendering ---------------------------------------------------------------------------


def test_rendered_config_loads_back_to_the_same_settings(tmp_path: Path) -> None:
    settings = load(
        tmp_path,
        r"""
        [[watch]]
        dir = "/data/ckpt/run1"
        layout = "hf"
        settle_seconds = 0.5
        [[watch]]
        dir = "/data/ckpt/other"
        run_id = "exp=3.b"
        marker = "DONE ✓"
        quiescence_seconds = 1e-3

        [destination]
        url = "s3://bucket/a/b"
        endpoint_url = "http://127.0.0.1:8333"
        region = "us-east-1"
        part_size_mib = 128
        concurrency = 16
        max_upload_mib_per_s = 250.5
        max_attempts = 3

        [retention]
        keep_last = 0
        keep_every_steps = 1000
        local_keep_last = 2

        [preemption]
        provider = "gcp"
        endpoint = "http://127.0.0.1:8080/base"
        poll_interval_seconds = 0.25
        imdsv1_fallback = true

        [trainer]
        match = "train.py --name \"x\\y\"\ttab"

        [metrics]
        listen = "[::1]:9000"

        [state]
        dir = "/tmp/ckptd state"
        """,
    )
    rendered = render_effective_config(settings)
    again = load_settings(write(tmp_path, rendered, "rendered.toml"), environ={})
    assert again == settings


def test_rendered_defaults_load_back_to_defaults(tmp_path: Path) -> None:
    rendered = render_effective_config(Settings())
    assert load_settings(write(tmp_path, rendered, "rendered.toml"), environ={}) == Settings()


def test_rendered_config_says_where_the_run_id_comes_from(tmp_path: Path) -> None:
    settings = load(tmp_path, environ={"CKPTD_WATCH": '[{"dir": "/d/run5"}]'})
    assert '# run_id unset: defaults to "run5"' in render_effective_config(settings)


# --- [cluster]: node_rank from the launcher's environment ---------------------------------


@pytest.mark.parametrize("variable", config.LAUNCHER_NODE_RANK_VARIABLES)
def test_node_rank_comes_from_a_launcher_variable(tmp_path: Path, variable: str) -> None:
    settings = load(tmp_path, "[cluster]\nnodes = 4", environ={variable: "3"})
    assert settings.cluster.node_rank == 3


def test_configured_node_rank_beats_the_launcher(tmp_path: Path) -> None:
    settings = load(tmp_path, "[cluster]\nnodes = 4\nnode_rank = 1", environ={"NODE_RANK": "3"})
    assert settings.cluster.rank == 1
    env = {"CKPTD_CLUSTER__NODE_RANK": "2", "NODE_RANK": "3"}
    assert load(tmp_path, "[cluster]\nnodes = 4", environ=env).cluster.rank == 2


def test_launcher_variables_are_tried_in_documented_order(tmp_path: Path) -> None:
    env = {"JOB_COMPLETION_INDEX": "3", "GROUP_RANK": "2"}
    assert load(tmp_path, "[cluster]\nnodes = 4", environ=env).cluster.rank == 2


def test_a_launcher_rank_that_is_not_a_number_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, "[cluster]\nnodes = 2", environ={"SKYPILOT_NODE_RANK": "one"})
    assert caught.value.key == "SKYPILOT_NODE_RANK"


def test_a_launcher_rank_beyond_the_cluster_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, "[cluster]\nnodes = 2", environ={"NODE_RANK": "5"})
    assert caught.value.key == "cluster.node_rank"


def test_one_node_ignores_a_stray_launcher_rank(tmp_path: Path) -> None:
    settings = load(tmp_path, "", environ={"NODE_RANK": "7"})
    assert settings.cluster.nodes == 1
    assert settings.cluster.rank == 0


TIERS_TOML = """
[destination]
url = "file:///mnt/nfs"
name = "nfs"

[retention]
keep_last = 3
keep_within = "12h"
local_keep_last = 2

[[tiers]]
name = "s3"
url = "s3://my-bucket/ckpt"
max_upload_mib_per_s = 200

[tiers.retention]
keep_last = 10
keep_within = "7d"
keep_every_steps = 5000

[[tiers]]
name = "dr"
url = "s3://other-bucket"
endpoint_url = "http://127.0.0.1:9000"
"""


def test_tiers_load_in_order_with_their_own_retention_and_render_back(tmp_path: Path) -> None:
    settings = load(tmp_path, TIERS_TOML)
    assert settings.destination.name == "nfs"
    assert settings.retention.keep_within_seconds == 12 * 3600
    assert [t.name for t in settings.tiers] == ["s3", "dr"]
    s3, dr = settings.tiers
    assert (s3.url, s3.max_upload_mib_per_s, s3.part_size_mib) == ("s3://my-bucket/ckpt", 200, 64)
    assert (s3.retention.keep_last, s3.retention.keep_every_steps) == (10, 5000)
    assert s3.retention.keep_within_seconds == 7 * 86400
    assert (dr.retention.keep_last, dr.retention.keep_within) == (5, "0")  # the defaults
    rendered = render_effective_config(settings)
    assert "[[tiers]]" in rendered and "[tiers.retention]" in rendered
    again = tmp_path / "again"
    again.mkdir()
    assert load(again, rendered) == settings


def test_one_destination_is_unchanged_by_tiers(tmp_path: Path) -> None:
    settings = load(tmp_path, '[destination]\nurl = "s3://bkt/p"\n')
    assert settings.tiers == [] and settings.destination.name == "primary"
    assert settings.retention.keep_within == "0"


# -- the control API's token and listener (issue #31) -------------------------------------


def test_token_file_is_read_and_a_systemd_credential_of_its_name_wins(tmp_path: Path) -> None:
    from ckptd.config.control import read_token

    (tmp_path / "etc").mkdir()
    (tmp_path / "creds").mkdir()
    (tmp_path / "etc" / "http-token").write_text("from-the-file\n")
    (tmp_path / "creds" / "http-token").write_text("from-systemd\n")
    http = config.HttpConfig(token_file=str(tmp_path / "etc" / "http-token"))
    assert read_token(http, {}) == "from-the-file"
    assert read_token(http, {"CREDENTIALS_DIRECTORY": str(tmp_path / "creds")}) == "from-systemd"
    assert read_token(http, {"CREDENTIALS_DIRECTORY": str(tmp_path / "none")}) == "from-the-file"


@pytest.mark.parametrize("content", [None, "", "two words\n"])
def test_an_unusable_token_file_is_a_config_error_naming_the_key(
    tmp_path: Path, content: str | None
) -> None:
    from ckptd.config.control import read_token

    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as err:
        read_token(config.HttpConfig(token_file=str(path)), {})
    assert err.value.key == "http.token_file" and str(path) in str(err.value)


def test_config_check_notes_a_reachable_scrape_listener_that_lost_the_control_api(
    tmp_path: Path,
) -> None:
    from ckptd.config.control import meaning_changes

    def changes(toml: str) -> list[str]:
        path = tmp_path / "c.toml"
        path.write_text(toml)
        return meaning_changes(load_settings(path, environ={}))

    (note,) = changes('[metrics]\nlisten = "0.0.0.0:9464"\n')
    assert "metrics.listen = 0.0.0.0:9464" in note and "http.listen" in note
    assert changes('[metrics]\nlisten = "127.0.0.1:9464"\n') == []  # loopback: as before
    # listen + token: the control API stays on the scrape listener, behind the token;
    # only the preemption state is public now, and that is said.
    (note,) = changes('[metrics]\nlisten = "0.0.0.0:9464"\n[http]\ntoken = "x"\n')
    assert "/v1/preemption no longer needs the http token" in note
