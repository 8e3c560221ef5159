"""Slim a Ray wheel for a local, one-node Ray without dashboard (what agentrl.deploy starts:
`ray.init(address="local", include_dashboard=False)`, actors, placement groups, runtime_env
env_vars), so it fits the 64 MiB a call may carry to the GPU machine.

    python slim_ray_wheel.py IN.whl OUT_DIR        # writes OUT_DIR/<same file name>

Dropped: the Java worker's jars, the dashboard web UI build, the libraries agentrl does not use
(rllib, tune, train, air, serve, data, llm; and the `serve` and `tune` console scripts) and
every tests/ and examples/ folder. Kept: all of
ray core (gcs_server, raylet, _raylet.so, _private incl. the runtime-env agent and its
thirdparty_files, autoscaler, dashboard's python agent modules, util, experimental, dag).
Stripped: debug symbols of gcs_server, raylet and _raylet.so (`strip --strip-unneeded`).
RECORD is rewritten (hashes and sizes of what is kept, as is); file modes are kept; the list of
what was removed is written into the wheel as ray/SLIMMED.txt.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

DROP_PREFIXES = (
    "ray/jars/",
    "ray/dashboard/client/",
    "ray/rllib/",
    "ray/tune/",
    "ray/train/",
    "ray/air/",
    "ray/serve/",
    "ray/data/",
    "ray/llm/",
)
DROP_SEGMENTS = ("tests", "examples")
STRIP = ("ray/_raylet.so", "ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet")


def dropped(name: str) -> bool:
    if name.startswith(DROP_PREFIXES):
        return True
    return any(part in DROP_SEGMENTS for part in name.split("/")[:-1])


def group(name: str) -> str:
    """The folder a removed file is listed under in ray/SLIMMED.txt."""
    for prefix in DROP_PREFIXES:
        if name.startswith(prefix):
            return prefix
    parts = name.split("/")
    cut = next(i for i, part in enumerate(parts[:-1]) if part in DROP_SEGMENTS)
    return "/".join(parts[: cut + 1]) + "/"


def record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def strip(data: bytes) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in"), os.path.join(tmp, "out")
        with open(src, "wb") as f:
            f.write(data)
        subprocess.run(["strip", "--strip-unneeded", src, "-o", dst], check=True)
        with open(dst, "rb") as f:
            return f.read()


def main(src: str, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    dst = os.path.join(out_dir, os.path.basename(src))
    zin = zipfile.ZipFile(src)
    # The wheel's own RECORD sits in the top-level dist-info (the vendored packages under
    # ray/**/thirdparty_files have theirs too).
    record_name = next(
        n for n in zin.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD")
    )
    removed: list[str] = []
    kept: list[tuple[zipfile.ZipInfo, bytes]] = []
    for info in zin.infolist():
        if info.filename == record_name:
            continue
        if dropped(info.filename):
            removed.append(info.filename)
            continue
        data = zin.read(info)
        if info.filename in STRIP:
            data = strip(data)
        elif info.filename.endswith(".dist-info/entry_points.txt"):  # `serve`, `tune` are gone
            lines = data.decode().splitlines()
            data = (
                "\n".join(x for x in lines if not x.startswith(("serve ", "tune "))) + "\n"
            ).encode()
        kept.append((info, data))
    groups = sorted({group(n) for n in removed})
    note = (
        "Slimmed for a local one-node Ray without dashboard (agentrl GPU carry, "
        "benchmarks/gpu/session14/slim_ray_wheel.py).\nStripped: "
        + ", ".join(STRIP)
        + f"\nRemoved {len(removed)} files under:\n"
        + "\n".join(groups)
        + "\n"
    ).encode()
    note_info = zipfile.ZipInfo("ray/SLIMMED.txt", date_time=(2026, 1, 1, 0, 0, 0))
    note_info.external_attr = 0o644 << 16
    kept.append((note_info, note))
    records = [f"{info.filename},{record_hash(data)},{len(data)}" for info, data in kept]
    records.append(f"{record_name},,")
    with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info, data in kept:
            new = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            new.external_attr = info.external_attr
            new.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(new, data, compresslevel=9)
        rec = zipfile.ZipInfo(record_name, date_time=(2026, 1, 1, 0, 0, 0))
        rec.external_attr = 0o644 << 16
        zout.writestr(rec, "\n".join(records) + "\n", compress_type=zipfile.ZIP_DEFLATED)
    before, after = os.path.getsize(src), os.path.getsize(dst)
    print(
        f"{os.path.basename(src)}: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB "
        f"({len(removed)} files removed, {len(STRIP)} binaries stripped)"
    )


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
