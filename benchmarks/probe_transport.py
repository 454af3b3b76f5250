"""What protocol 2 would do with a transport that costs what a socket costs: a probe, not a feature.

Runs ``compare_remote.py``'s protocol-2 path (:class:`~torchrl_asyncpool.remote.RemoteVectorSlot`
fed by :class:`~torchrl_asyncpool.remote.VectorEnvHost` processes, same envs, same hosts, same
pool and consumer loop) with its gRPC streams swapped for plain TCP connections that carry the
same protocol-2 messages with gRPC's 5-byte message prefix and no HTTP/2, each message read and
written by the thread that uses it (the slot's worker thread in the pool, the serve loop or one
sender thread in the host). This is **not a wire format of the package**: no gRPC client can
talk to it, nothing is authenticated or bounded, a host that drops is not handled. It measures
how much of the remote path is gRPC's Python stack (three threads per message on each side)
and how much is the rest, next to the same runs over gRPC and the comparison's baseline, in
interleaved order::

    python benchmarks/probe_transport.py --workload cartpole --repeats 2   # p1 (gRPC), p2 over gRPC, p2 over TCP
    python benchmarks/probe_transport.py --workload sleep2ms --repeats 2   # local workers, p2 over gRPC, p2 over TCP
"""
from __future__ import annotations

import argparse
import os
import socket
import struct
import threading
import time

_HDR = struct.Struct(">BI")  # gRPC's message prefix: compressed flag, big-endian length


class _TcpStream:
    """One host connection: what :class:`RemoteVectorSlot` and :class:`VectorEnvHost` ask of
    a stream (``requests``, ``send``, ``end``, ``peer``, ``deadline``, ``timed_out``)."""

    def __init__(self, sock, peer):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.s, self.peer = sock, str(peer)
        self.deadline, self.timed_out, self.ended = None, False, False
        self._prefix = bytearray(5)
        self._lock = threading.Lock()
        self.requests = self._messages()

    def _fill(self, buf, n):
        view, got = memoryview(buf), 0
        while got < n:
            r = self.s.recv_into(view[got:], n - got)
            if not r:
                raise EOFError
            got += r

    def read(self):
        self._fill(self._prefix, 5)
        n = _HDR.unpack_from(self._prefix)[1]
        buf = bytearray(n)
        self._fill(buf, n)
        return bytes(buf) if n < 4096 else buf

    def _messages(self):
        while True:
            try:
                yield self.read()
            except (EOFError, OSError):
                return

    def send(self, msg):
        from torchrl_asyncpool.remote.slot import _HostLost

        if self.ended:
            raise _HostLost("the stream ended")
        try:
            with self._lock:
                if len(msg) < 65536:
                    self.s.sendall(_HDR.pack(0, len(msg)) + bytes(msg))
                else:
                    self.s.sendall(_HDR.pack(0, len(msg)))
                    self.s.sendall(msg)
        except OSError as exc:
            raise _HostLost(str(exc)) from None

    def end(self, code=None, details=None):
        self.ended = True
        try:
            self.s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _TcpIngress:
    """Stands in for ``remote.slot._Ingress`` in the pool's worker: accepts hosts on the address,
    reads the hello, hands the stream to a free block, sends the accept."""

    _by_address: dict = {}

    @classmethod
    def join(cls, slot, stop_fd=None):
        ingress = cls._by_address.get(slot.address)
        if ingress is None:
            ingress = cls._by_address[slot.address] = cls(slot.address)
        ingress.slots.append(slot)
        return ingress

    def __init__(self, address):
        host, port = address.rsplit(":", 1)
        self.listener = socket.create_server((host, int(port)))
        self.slots = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                sock, peer = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, peer), daemon=True).start()

    def _serve(self, sock, peer):
        from torchrl_asyncpool.remote import protocol as P

        stream = _TcpStream(sock, peer)
        hello = P.decode_hello(stream.read())
        num_envs = hello.pop("num_envs", None)
        for slot in list(self.slots):
            if slot._attach(stream):
                stream.send(P.encode_accept(stream.accept_index, num_envs))
                return
        sock.close()

    def leave(self, slot):
        self.slots.remove(slot)
        if not self.slots:
            self.listener.close()


def _tcp_host_stream(self, hello, serve, channel_options=(), outbox=None):
    """Stands in for ``EnvHost._stream`` in the host process."""
    from torchrl_asyncpool.remote import protocol as P
    from torchrl_asyncpool.remote.slot import _HostLost

    host, port = self.address.rsplit(":", 1)
    deadline = time.monotonic() + self.connect_timeout
    while True:
        try:
            sock = socket.create_connection((host, int(port)))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise ConnectionError(f"no pool accepts connections on {self.address}") from None
            time.sleep(0.05)
    stream = _TcpStream(sock, self.address)
    try:
        stream.send(hello)
        try:
            self.slot = P.decode_accept(stream.read())
        except EOFError:
            return self.steps
        if outbox is None:  # envs stepped together: the serve loop reads and writes
            serve(stream.requests, stream.send)
            return self.steps

        def pump():  # envs stepped one by one: one thread sends what the outbox gathers
            try:
                for msg in outbox:
                    stream.send(msg)
            except _HostLost:
                pass

        threading.Thread(target=pump, daemon=True).start()
        serve(stream.requests, outbox.put)
        outbox.put(None)
        return self.steps
    finally:
        sock.close()


def _tcp_slot_class():
    from torchrl_asyncpool.remote import vector_slot
    from torchrl_asyncpool.remote.vector_slot import RemoteVectorSlot

    class TcpVectorSlot(RemoteVectorSlot):
        def reset(self, **kwargs):
            vector_slot._Ingress = _TcpIngress  # in the pool's worker process, before it listens
            return super().reset(**kwargs)

    TcpVectorSlot.__qualname__ = TcpVectorSlot.__name__ = "TcpVectorSlot"
    return TcpVectorSlot


# built on import: the pool's workers import this module to unpickle the factories
TcpVectorSlot = _tcp_slot_class()

_TCP_HOST_PREFIX = ("import sys; sys.path.insert(0, {here!r}); import probe_transport as _pt; "
                    "from torchrl_asyncpool.remote.vector_host import VectorEnvHost as _V; "
                    "_V._stream = _pt._tcp_host_stream\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="cartpole", choices=["cartpole", "sleep2ms"])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import compare_remote as cr
    import probe_transport  # this module under its own name: the pool's workers unpickle the factories from it
    import torch

    torch.set_num_threads(1)
    here = os.path.dirname(os.path.abspath(__file__))
    grpc_slot, grpc_host = cr.RemoteVectorSlot, cr._VECTOR_HOST
    tcp_host = _TCP_HOST_PREFIX.format(here=here) + grpc_host
    if args.workload == "cartpole":  # against protocol 1, the same 32 envs in 2 host processes
        n, host_envs, mode = 32, 32, "vector_entry_point"
        base = ("protocol 1", lambda: cr.run_remote("cartpole", 32, args.seconds, 2))
    else:  # against local workers
        n, host_envs, mode = 64, 16, "threads"
        base = ("local", lambda: cr.run_local("sleep2ms", 64, args.seconds))
    rows = []
    for rep in range(args.repeats):
        for impl in (base[0], "protocol 2, gRPC", "protocol 2, TCP"):
            if impl == base[0]:
                rate, cpu = base[1]()
            else:
                tcp = impl.endswith("TCP")
                cr.RemoteVectorSlot = probe_transport.TcpVectorSlot if tcp else grpc_slot
                cr._VECTOR_HOST = tcp_host if tcp else grpc_host
                try:
                    rate, cpu = cr.run_remote2(args.workload, n, args.seconds, host_envs, mode)
                finally:
                    cr.RemoteVectorSlot, cr._VECTOR_HOST = grpc_slot, grpc_host
            rows.append({"workload": args.workload, "envs": n, "impl": impl, "repeat": rep, "records_per_s": rate,
                         "cpu_us_per_record": cpu})
            print(f"{args.workload:9} {n:>3} {impl:17} {rate:>9.0f} records/s   CPU us per record: driver "
                  f"{cpu['driver']:.0f} / pool workers {cpu['workers']:.0f} / hosts {cpu['hosts']:.0f}", flush=True)
    if args.json:
        cr.write_json(args.json, rows)


if __name__ == "__main__":
    import gymnasium as gym

    gym.logger.min_level = 40
    main()
