"""What this node has: installed packages, torch's view of the GPUs, network interfaces, free
ports, readable and writable paths. Every probe returns a value and never raises: a broken
environment is what the doctor is there to describe."""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import shutil
import socket
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class Package:
    module: str
    version: Optional[str]  # the installed distribution's version, None when it is absent
    error: Optional[str]  # why `import module` failed; None when it imports

    @property
    def imports(self) -> bool:
        return self.error is None


def package(module: str, *distributions: str) -> Package:
    """Imports `module` (a broken install fails here, not only a missing one) and reads the
    version of the first of `distributions` that is installed."""
    error = None
    try:
        with warnings.catch_warnings():  # megatron warns at import that TE and apex are absent
            warnings.simplefilter("ignore")
            importlib.import_module(module)
    except ModuleNotFoundError as exc:
        own = exc.name is not None and (module == exc.name or module.startswith(exc.name + "."))
        error = "absent" if own else f"needs {exc.name}, which is absent"
    except Exception as exc:  # noqa: BLE001 - TE fails with OSError for a missing .so, apex with anything
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    version = None
    for dist in distributions or (module,):
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return Package(module, version, error)


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float


@dataclass(frozen=True)
class TorchView:
    version: Optional[str]  # None: torch does not import
    error: Optional[str] = None
    cuda_build: Optional[str] = None  # torch.version.cuda: None for a CPU build
    cuda_available: bool = False
    gpus: tuple[Gpu, ...] = ()
    nccl: Optional[str] = None


@functools.lru_cache(maxsize=1)
def torch_view() -> TorchView:
    """torch's view of this node's GPUs (once: CUDA initialises only once per process)."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return TorchView(None, f"{type(exc).__name__}: {exc}")
    view = TorchView(torch.__version__, cuda_build=torch.version.cuda)
    try:
        if not torch.cuda.is_available():
            return view
        gpus = tuple(Gpu(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory / 2**30)
                     for i in range(torch.cuda.device_count()))
    except Exception as exc:  # noqa: BLE001 - a broken driver or GPU is what the doctor reports
        return TorchView(torch.__version__, f"CUDA: {type(exc).__name__}: {exc}", cuda_build=torch.version.cuda)
    try:
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - a build without NCCL
        nccl = None
    return TorchView(torch.__version__, cuda_build=torch.version.cuda, cuda_available=True, gpus=gpus, nccl=nccl)


@dataclass(frozen=True)
class Interface:
    name: str
    up: bool
    ipv4: tuple[str, ...] = field(default=())


def interfaces() -> dict[str, Interface]:
    import psutil

    stats = psutil.net_if_stats()
    out = {}
    for name, addresses in psutil.net_if_addrs().items():
        ipv4 = tuple(a.address for a in addresses if a.family == socket.AF_INET)
        out[name] = Interface(name, bool(stats.get(name) and stats[name].isup), ipv4)
    return out


def port_taken(host: str, port: int) -> Optional[str]:
    """None if a server could bind `host:port` now, else why not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # as uvicorn (SGLang) and the router bind: sockets of the previous job in TIME_WAIT do not count
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def unreadable(path: Path) -> Optional[str]:
    """None if `path` (a file, or a folder and the files in it) can be read, else why not."""
    try:
        os.stat(path)  # raises where Path.exists() would (a parent folder that cannot be entered)
        files = [path] if path.is_file() else [p for p in sorted(path.iterdir()) if p.is_file()]
        for file in files:
            with open(file, "rb") as handle:
                handle.read(1)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and Path(exc.filename) != path else ""
        return f"{exc.strerror or exc}{where}"
    return None


@dataclass(frozen=True)
class WritableFolder:
    existing: Path  # the folder itself, or its nearest existing parent (where it will be made)
    error: Optional[str]  # None: a file could be written there
    free_bytes: Optional[int]  # None: unknown (then error says why)


def writable_folder(path: Path) -> WritableFolder:
    """Writes and removes a file in `path` or its nearest existing parent: permissions alone
    say nothing for root, a read-only mount or a full quota."""
    existing = path.absolute()
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    error = None
    try:
        fd, probe = tempfile.mkstemp(prefix=".megatron-grpo-doctor-", dir=existing)
        try:
            os.write(fd, b"x")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        error = exc.strerror or str(exc)
    try:
        free: Optional[int] = shutil.disk_usage(existing).free
    except OSError as exc:
        free = None
        error = error or f"cannot read its free space: {exc.strerror or exc}"
    return WritableFolder(existing, error, free)
