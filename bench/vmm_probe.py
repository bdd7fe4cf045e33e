"""Can a GPU pool outlive the process that made it? A probe for a CUDA VMM backend.

    python3 bench/vmm_probe.py [--size 64MiB] [--json-out FILE]

A future pool backend: memd allocates with the CUDA driver's virtual memory
API (`cuMemCreate` with POSIX file descriptor handles) and hands workers the
fd over a Unix socket, as the shm backend does today. The memory then lives
while any process maps it, so a memd crash would no longer lose the pool.
This probe checks the steps that design rests on, each in real processes:

  A (exporter)  cuMemCreate + map, fill 0xA5 (cuMemsetD8), export an fd, send it to B
  B (importer)  import, map, see 0xA5 through a torch tensor over the mapping
  A is SIGKILLed; B still sees 0xA5, then writes a pattern of its own
  B re-exports its imported handle as a new fd (informative)
  C (fresh)     gets A's original fd from B, maps it, sees B's pattern; also the re-exported fd
  B unmaps and releases everything but the fd; D (fresh) gets that fd: does an fd
                alone keep the memory alive? (informative: systemd's fd store would rely on it)

One line per step, PASS/FAIL with its time; a final JSON line. Every wait has
a timeout, every child is killed at the end whatever happened. Needs
cuda-python (`cuda.bindings`) and torch with CUDA; imports them only when run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

REPLY_TIMEOUT_S = 45.0        # one step in a child (a torch import and CUDA start-up included)
PROBE_DEADLINE_S = 100        # the whole probe, whatever hangs
CHILD_DEADLINE_S = 150        # a child kills itself after this long, orphaned or not
FILL_BYTE = 0xA5
PATTERN_SEED = 17


def parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    low = text.strip().lower()
    for suffix, mult in units.items():
        if low.endswith(suffix):
            return int(float(low[: -len(suffix)]) * mult)
    return int(low)


# ---- the child: one process holding (or not) a mapping of the allocation ---------------------------

class CudaError(RuntimeError):
    pass


class ProbeDeadline(Exception):
    """Not an OSError: a step's own error handling must not swallow it."""


def load_driver() -> Any:
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        from cuda import cuda as cu  # cuda-python < 12.6
    return cu


class DeviceSpan:
    """Device bytes as torch (or cupy, numba) can wrap them without a copy."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}


class Child:
    """Obeys JSON commands on its control socket; peers are sockets to other children for passing fds."""

    def __init__(self, name: str, ctl: socket.socket, peers: dict[str, socket.socket]) -> None:
        self.name, self.ctl, self.peers = name, ctl, peers
        self.cu: Any = None
        self.device = 0
        self.handle: Any = None
        self.ptr = 0
        self.size = 0
        self.mapped = False
        self.fd: int | None = None           # the fd this process received (kept to pass on)
        self.reexported: int | None = None
        self.extra_fds: list[int] = []                 # further fds received with the first
        self.extra: list[tuple[Any, int, int]] = []    # (handle, ptr, size) of their mappings
        self.torch: Any = None
        self.wrapped_by = ""

    # -- helpers --
    def check(self, result: Any, what: str) -> Any:
        cu = self.cu
        if not isinstance(result, tuple):
            result = (result,)
        err = result[0]
        if err != cu.CUresult.CUDA_SUCCESS:
            name = ""
            try:
                _e, raw = cu.cuGetErrorName(err)
                name = raw.decode() if isinstance(raw, bytes) else str(raw)
            except Exception:
                name = str(err)
            raise CudaError(f"{what} failed: {name}")
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]

    def prop(self) -> Any:
        cu = self.cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return prop

    def map(self, handle: Any, size: int) -> int:
        cu = self.cu
        ptr = self.check(cu.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
        self.check(cu.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.check(cu.cuMemSetAccess(ptr, size, [access], 1), "cuMemSetAccess")
        return int(ptr)

    def unmap(self, handle: Any, ptr: int, size: int) -> None:
        cu = self.cu
        self.check(cu.cuMemUnmap(ptr, size), "cuMemUnmap")
        self.check(cu.cuMemAddressFree(ptr, size), "cuMemAddressFree")
        self.check(cu.cuMemRelease(handle), "cuMemRelease")

    def tensor(self, ptr: int, size: int) -> Any:
        """A uint8 torch tensor over the mapping, zero copy (checked)."""
        if self.torch is None:
            import torch
            torch.cuda.init()
            self.torch = torch
        torch = self.torch

        try:
            t = torch.as_tensor(DeviceSpan(ptr, size), device=f"cuda:{self.device}")
            self.wrapped_by = "torch.as_tensor(__cuda_array_interface__)"
        except Exception as exc:          # then through cupy and DLPack, and say so
            import cupy
            memory = cupy.cuda.UnownedMemory(ptr, size, None, self.device)
            array = cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
            t = torch.from_dlpack(array)
            self.wrapped_by = f"cupy + DLPack (torch.as_tensor failed: {type(exc).__name__}: {exc})"
        if t.data_ptr() != ptr or t.numel() != size:
            raise RuntimeError(f"torch copied instead of wrapping: data_ptr {t.data_ptr():#x} != {ptr:#x}")
        return t

    def expected(self, seed: int) -> Any:
        torch = self.torch
        idx = torch.arange(self.size, dtype=torch.int32, device=f"cuda:{self.device}")
        return ((idx % 251 * 131 + seed) % 251).to(torch.uint8)      # int32 never overflows here

    def verify(self, ptr: int, what: str, seed: int | None) -> dict[str, Any]:
        t = self.tensor(ptr, self.size)
        want = FILL_BYTE if seed is None else self.expected(seed)
        good = int((t == want).sum().item())
        self.torch.cuda.synchronize(self.device)
        head = t[:8].tolist()
        if good != self.size:
            raise AssertionError(f"{what}: {self.size - good} of {self.size} bytes differ (head {head})")
        return {"bytes_checked": self.size, "head": head, "wrapped_by": self.wrapped_by}

    # -- commands --
    def do_init(self, cmd: dict) -> dict:
        self.cu = cu = load_driver()
        self.check(cu.cuInit(0), "cuInit")
        dev = self.check(cu.cuDeviceGet(self.device), "cuDeviceGet")
        name = self.check(cu.cuDeviceGetName(128, dev), "cuDeviceGetName")
        name = name.split(b"\0")[0].decode() if isinstance(name, bytes) else str(name)
        attrs = {}
        for label, names in (("vmm", ("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                                      "CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED")),
                             ("posix_fd", ("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",))):
            for attr in names:
                if hasattr(cu.CUdevice_attribute, attr):
                    attrs[label] = self.check(cu.cuDeviceGetAttribute(getattr(cu.CUdevice_attribute, attr), dev),
                                              f"cuDeviceGetAttribute({attr})")
                    break
        ctx = self.check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self.check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        version = self.check(cu.cuDriverGetVersion(), "cuDriverGetVersion")
        if cmd.get("torch"):
            self.tensor_import()
        return {"device": name, "driver_version": version, "attributes": attrs, "pid": os.getpid(),
                "bindings": cu.__name__}

    def tensor_import(self) -> None:
        import torch
        torch.cuda.init()
        self.torch = torch

    def do_create(self, cmd: dict) -> dict:
        cu = self.cu
        prop = self.prop()
        minimum = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        gran = self.check(cu.cuMemGetAllocationGranularity(prop, minimum), "cuMemGetAllocationGranularity")
        gran = int(gran)
        self.size = -(-int(cmd["size"]) // gran) * gran
        self.handle = self.check(cu.cuMemCreate(self.size, prop, 0), "cuMemCreate(POSIX_FILE_DESCRIPTOR)")
        self.ptr = self.map(self.handle, self.size)
        self.mapped = True
        return {"size": self.size, "granularity": gran, "ptr": hex(self.ptr)}

    def do_fill(self, cmd: dict) -> dict:
        cu = self.cu
        self.check(cu.cuMemsetD8(self.ptr, FILL_BYTE, self.size), "cuMemsetD8")
        self.check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        return {"byte": FILL_BYTE}

    def do_export_send(self, cmd: dict) -> dict:
        cu = self.cu
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        fd = int(self.check(cu.cuMemExportToShareableHandle(self.handle, kind, 0), "cuMemExportToShareableHandle"))
        try:
            socket.send_fds(self.peers[cmd["peer"]], [json.dumps({"size": self.size}).encode()], [fd])
        finally:
            os.close(fd)          # the peer has its own copy now; this process keeps its handle
        return {"fd": fd}

    def do_send_fd(self, cmd: dict) -> dict:
        fds = [self.fd] + ([self.reexported] if cmd.get("with_reexported") and self.reexported is not None else [])
        socket.send_fds(self.peers[cmd["peer"]], [json.dumps({"size": self.size}).encode()], fds)
        return {"fds_sent": len(fds)}

    def do_recv_import(self, cmd: dict) -> dict:
        cu = self.cu
        sock = self.peers[cmd["peer"]]
        sock.settimeout(REPLY_TIMEOUT_S)
        msg, fds, _flags, _addr = socket.recv_fds(sock, 4096, 4)
        if not fds:
            raise RuntimeError("no fd arrived")
        self.size = json.loads(msg)["size"]
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.fd = fds[0]
        self.handle = self.check(cu.cuMemImportFromShareableHandle(self.fd, kind), "cuMemImportFromShareableHandle")
        self.ptr = self.map(self.handle, self.size)
        self.mapped = True
        self.extra_fds = fds[1:]
        return {"fds_received": len(fds), "size": self.size, "ptr": hex(self.ptr)}

    def do_import_extra(self, cmd: dict) -> dict:
        """Map the second fd received (B's re-export) too; both mappings must show the same bytes."""
        cu = self.cu
        if not self.extra_fds:
            raise RuntimeError("no second fd was received")
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        handle = self.check(cu.cuMemImportFromShareableHandle(self.extra_fds[0], kind),
                            "cuMemImportFromShareableHandle(re-exported fd)")
        ptr = self.map(handle, self.size)
        self.extra.append((handle, ptr, self.size))
        out = self.verify(ptr, "through the re-exported fd", cmd.get("seed"))
        # One write through this mapping must show through the first: the same physical memory.
        t2, t1 = self.tensor(ptr, self.size), self.tensor(self.ptr, self.size)
        saved = t2[:4].clone()
        t2[:4] = 7
        self.torch.cuda.synchronize(self.device)
        same = t1[:4].tolist() == [7, 7, 7, 7]
        t2[:4] = saved
        self.torch.cuda.synchronize(self.device)
        if not same:
            raise AssertionError("the re-exported fd maps different memory")
        return {**out, "same_memory": same}

    def do_check(self, cmd: dict) -> dict:
        return self.verify(self.ptr, "the mapping", cmd.get("seed"))

    def do_write(self, cmd: dict) -> dict:
        t = self.tensor(self.ptr, self.size)
        t.copy_(self.expected(cmd["seed"]))
        self.torch.cuda.synchronize(self.device)
        return {"seed": cmd["seed"]}

    def do_reexport(self, cmd: dict) -> dict:
        cu = self.cu
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.reexported = int(self.check(cu.cuMemExportToShareableHandle(self.handle, kind, 0),
                                         "cuMemExportToShareableHandle(imported handle)"))
        return {"fd": self.reexported}

    def do_release(self, cmd: dict) -> dict:
        """Unmap and release every handle; keep the fds."""
        if self.mapped:
            self.unmap(self.handle, self.ptr, self.size)
            self.mapped = False
        for handle, ptr, size in self.extra:
            self.unmap(handle, ptr, size)
        self.extra = []
        return {"holding_fds": [fd for fd in (self.fd, self.reexported) if fd is not None]}

    def do_exit(self, cmd: dict) -> dict:
        out = self.do_release(cmd) if self.cu is not None else {}
        for fd in [self.fd, self.reexported, *self.extra_fds]:
            if fd is not None:
                os.close(fd)
        self.fd = self.reexported = None
        self.extra_fds = []
        return out

    def serve(self) -> int:
        while True:
            data = self.ctl.recv(1 << 16)
            if not data:
                return 1                      # the parent went away
            cmd = json.loads(data)
            start = time.perf_counter()
            try:
                reply = {"ok": True, **(getattr(self, f"do_{cmd['op']}")(cmd) or {})}
            except Exception as exc:
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            reply["child_ms"] = round((time.perf_counter() - start) * 1e3, 3)
            self.ctl.send(json.dumps(reply).encode())
            if cmd["op"] == "exit":
                return 0 if reply["ok"] else 1


def child_main(args: argparse.Namespace) -> int:
    signal.alarm(CHILD_DEADLINE_S)            # never outlive a hung parent by long
    ctl = socket.socket(fileno=args.ctl)
    peers = {}
    for spec in args.peer:
        name, fd = spec.split("=")
        peers[name] = socket.socket(fileno=int(fd))
    return Child(args.child, ctl, peers).serve()


# ---- the parent: spawns the children, runs the steps, reports --------------------------------------

class Probe:
    def __init__(self, size: int) -> None:
        self.size = size
        self.children: dict[str, tuple[subprocess.Popen, socket.socket]] = {}
        self.steps: list[dict[str, Any]] = []
        self.info: dict[str, Any] = {}

    def spawn(self, name: str, peers: dict[str, socket.socket]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, os.path.abspath(__file__), "--child", name, "--ctl", str(theirs.fileno())]
        for peer, sock in peers.items():
            argv += ["--peer", f"{peer}={sock.fileno()}"]
        proc = subprocess.Popen(argv, pass_fds=[theirs.fileno(), *(s.fileno() for s in peers.values())])
        theirs.close()
        for sock in peers.values():
            sock.close()                      # the child has them now
        ours.settimeout(REPLY_TIMEOUT_S)
        self.children[name] = (proc, ours)

    def ask(self, name: str, op: str, **fields: Any) -> dict[str, Any]:
        proc, sock = self.children[name]
        start = time.perf_counter()
        try:
            sock.send(json.dumps({"op": op, **fields}).encode())
            data = sock.recv(1 << 16)
            reply = json.loads(data) if data else {"ok": False, "error": f"{name} exited ({proc.poll()})"}
        except (OSError, TimeoutError) as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            if proc.poll() is None:           # a late reply would answer the next question: no next question
                proc.kill()
                proc.wait()
        reply["ms"] = round((time.perf_counter() - start) * 1e3, 3)
        return reply

    def record(self, step: str, reply: dict[str, Any], *, required: bool = True) -> bool:
        ok = bool(reply.get("ok"))
        entry = {"step": step, "ok": ok, "required": required, **reply}
        self.steps.append(entry)
        details = {k: v for k, v in reply.items() if k not in ("ok", "ms", "child_ms")}
        tag = "PASS" if ok else ("FAIL" if required else "FAIL (informative)")
        print(f"{tag:<19} {step:<62} {reply.get('ms', 0):>10.1f} ms  {json.dumps(details)}", flush=True)
        return ok

    def run(self) -> bool:
        ab = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        bc = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        bd = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.spawn("A", {"b": ab[0]})
        self.spawn("B", {"a": ab[1], "c": bc[0], "d": bd[0]})
        init_a = self.ask("A", "init")
        if not self.record("A: cuInit, device 0, primary context (driver only, no torch)", init_a):
            return False
        self.info.update({k: init_a.get(k) for k in ("device", "driver_version", "attributes", "bindings")})
        if not self.record("B: cuInit + torch.cuda.init", self.ask("B", "init", torch=True)):
            return False
        created = self.ask("A", "create", size=self.size)
        if not self.record("A: cuMemCreate(POSIX_FILE_DESCRIPTOR) + reserve/map/access", created):
            return False
        self.info.update(size=created["size"], granularity=created["granularity"])
        if not self.record(f"A: cuMemsetD8 {FILL_BYTE:#x} over the allocation", self.ask("A", "fill")):
            return False
        if not self.record("A: cuMemExportToShareableHandle -> fd, send_fds to B", self.ask("A", "export_send",
                                                                                            peer="b")):
            return False
        if not self.record("B: recv_fds, cuMemImportFromShareableHandle, map", self.ask("B", "recv_import", peer="a")):
            return False
        if not self.record(f"B: sees {FILL_BYTE:#x} through a torch tensor over its mapping", self.ask("B", "check")):
            return False

        proc_a, _ = self.children["A"]
        start = time.perf_counter()
        proc_a.send_signal(signal.SIGKILL)
        try:
            code = proc_a.wait(timeout=30)
            killed = {"ok": code == -signal.SIGKILL, "exit": code}
        except subprocess.TimeoutExpired:
            killed = {"ok": False, "error": "A did not die within 30 s"}
        killed["ms"] = round((time.perf_counter() - start) * 1e3, 3)
        if not self.record("A: SIGKILLed (the exporter dies, no clean-up)", killed):
            return False
        survived = self.record(f"B: still sees {FILL_BYTE:#x} after A's death", self.ask("B", "check"))
        if not survived:
            return False
        if not self.record("B: writes a pattern of its own (torch)", self.ask("B", "write", seed=PATTERN_SEED)):
            return False
        self.record("B: checks its pattern", self.ask("B", "check", seed=PATTERN_SEED))
        reexported = self.record("B: re-exports its imported handle as a new fd", self.ask("B", "reexport"),
                                 required=False)

        self.spawn("C", {"b": bc[1]})
        if not self.record("C: cuInit + torch.cuda.init (a fresh process)", self.ask("C", "init", torch=True)):
            return False
        if not self.record("B: passes the fd it received from A on to C",
                           self.ask("B", "send_fd", peer="c", with_reexported=reexported)):
            return False
        if not self.record("C: imports A's original fd and maps it", self.ask("C", "recv_import", peer="b")):
            return False
        self.record("C: sees B's pattern", self.ask("C", "check", seed=PATTERN_SEED))
        if reexported:
            self.record("C: maps B's re-exported fd too: same memory, same pattern",
                        self.ask("C", "import_extra", seed=PATTERN_SEED), required=False)
        self.record("C: unmaps, releases, exits cleanly", self.ask("C", "exit"))
        self.reap("C")

        self.record("B: unmaps and releases its handle, keeps only the fd", self.ask("B", "release"), required=False)
        self.spawn("D", {"b": bd[1]})
        if self.record("D: cuInit + torch.cuda.init (a fresh process)", self.ask("D", "init", torch=True),
                       required=False):
            sent = self.record("B: passes the bare fd to D", self.ask("B", "send_fd", peer="d"), required=False)
            if sent and self.record("D: imports the bare fd and maps it", self.ask("D", "recv_import", peer="b"),
                                    required=False):
                self.record("D: sees B's pattern: an fd alone keeps the memory alive",
                            self.ask("D", "check", seed=PATTERN_SEED), required=False)
        self.record("D: exits cleanly", self.ask("D", "exit"), required=False)
        self.reap("D")
        self.record("B: exits cleanly", self.ask("B", "exit"))
        self.reap("B")
        return all(s["ok"] for s in self.steps if s["required"])

    def reap(self, name: str) -> None:
        proc, sock = self.children[name]
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        sock.close()

    def close(self) -> None:
        for proc, sock in self.children.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            sock.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="64MiB", help="bytes to allocate (rounded up to the granularity)")
    p.add_argument("--json-out", help="also write the final JSON to this file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--ctl", type=int, help=argparse.SUPPRESS)
    p.add_argument("--peer", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_main(args)

    def deadline(_sig: int, _frame: Any) -> None:
        raise ProbeDeadline(f"the probe ran past {PROBE_DEADLINE_S} s")
    signal.signal(signal.SIGALRM, deadline)
    signal.alarm(PROBE_DEADLINE_S)
    probe = Probe(parse_size(args.size))
    start = time.perf_counter()
    error = None
    try:
        ok = probe.run()
    except Exception as exc:                 # a timeout or a bug here: report what ran, kill the rest
        ok, error = False, f"{type(exc).__name__}: {exc}"
        print(f"FAIL                probe aborted: {error}", flush=True)
    finally:
        signal.alarm(0)
        probe.close()
    result = {"vmm_probe": {"ok": ok, "error": error, "seconds": round(time.perf_counter() - start, 3),
                            **probe.info, "steps": probe.steps}}
    line = json.dumps(result)
    print(line, flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
