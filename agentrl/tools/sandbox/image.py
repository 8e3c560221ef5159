"""The Docker sandbox image, built offline: the host's system Python, its standard library and the
shared libraries they load, tarred into a root filesystem and `docker import`ed. No registry."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

IMAGE = "agentrl-sandbox:py3"
_SKIP_DIRS = {
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "site-packages",
    "dist-packages",
}
_PASSWD = "root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/work:/sbin/nologin\n"
_GROUP = "root:x:0:\nnogroup:x:65534:\n"


def _stdlib_dir(python: str) -> Path:
    out = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def _shared_libs(binaries: list[Path]) -> set[Path]:
    """Every library `ldd` resolves for these binaries, plus the dynamic loader itself."""
    libs: set[Path] = set()
    for binary in binaries:
        done = subprocess.run(["ldd", str(binary)], capture_output=True, text=True)
        for line in done.stdout.splitlines():
            m = re.search(r"(/\S+)\s+\(0x", line)
            if m:
                libs.add(Path(m.group(1)))
    return libs


def _rootfs_files(python: str) -> tuple[Path, Path, list[Path]]:
    interpreter = Path(os.path.realpath(python))
    stdlib = _stdlib_dir(str(interpreter))
    files = [
        p
        for p in stdlib.rglob("*")
        if p.is_file() and not (_SKIP_DIRS & set(p.relative_to(stdlib).parts))
    ]
    extensions = [p for p in files if p.suffix == ".so"]
    return interpreter, stdlib, sorted({*files, *_shared_libs([interpreter, *extensions])})


def build_rootfs_tar(out: str | Path, python: str = "/usr/bin/python3") -> Path:
    """Write the root filesystem tarball; paths keep their host locations (symlinks resolved)."""
    interpreter, _, files = _rootfs_files(python)
    out = Path(out)
    with tarfile.open(out, "w") as tar:
        for d in ("/work", "/tmp", "/etc", "/usr/bin"):
            info = tarfile.TarInfo(d.lstrip("/"))
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if d in ("/work", "/tmp") else 0o755
            tar.addfile(info)
        for path in [interpreter, *files]:
            tar.add(os.path.realpath(path), arcname=str(path).lstrip("/"), recursive=False)
        for name, text in (("etc/passwd", _PASSWD), ("etc/group", _GROUP)):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
        for link in ("usr/bin/python3", "usr/bin/python"):
            if link.lstrip("/") != str(interpreter).lstrip("/"):
                info = tarfile.TarInfo(link)
                info.type = tarfile.SYMTYPE
                info.linkname = str(interpreter)
                tar.addfile(info)
    return out


def build_image(
    client=None, *, tag: str = IMAGE, python: str = "/usr/bin/python3", force: bool = False
) -> str:
    """Import the image into the local daemon (idempotent unless `force`); returns its tag."""
    import docker
    import docker.errors

    client = client or docker.from_env()
    if not force:
        try:
            client.images.get(tag)
            return tag
        except docker.errors.ImageNotFound:
            pass
    repository, _, version = tag.partition(":")
    with tempfile.TemporaryDirectory() as tmp:
        tar = build_rootfs_tar(Path(tmp) / "rootfs.tar", python)
        client.api.import_image_from_file(str(tar), repository=repository, tag=version or "latest")
    client.images.get(tag)  # raises if the import did not land
    return tag


if __name__ == "__main__":
    force = "--force" in sys.argv
    print(build_image(force=force))
