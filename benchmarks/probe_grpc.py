"""What gRPC's Python stack costs per record, without the pool: the floor under remote env slots.

Five probes, each ``--records`` round trips of 100-byte messages over 127.0.0.1:

* ``pingpong``      a bare bidirectional stream, client and server in this process;
* ``sync bridge``   the ingress design of ``torchrl_asyncpool.remote``: a threaded gRPC server
                    whose stream handler yields commands from a queue while another thread
                    reads the records (a client in another process); server CPU per record;
* ``aio bridge``    the same with a ``grpc.aio`` server on an event loop thread, the waiting
                    thread bridged through ``asyncio.run_coroutine_threadsafe``;
* ``host client``   the env hosts' side: a client process echoing through a threaded gRPC
                    server, over grpcio's public stream (a request-iterator thread and the
                    channel's polling thread besides the caller) and over the single-threaded
                    call hosts use (``torchrl_asyncpool.remote.host_call``); client CPU;
* ``raw socket``    the floor under any of them: the same round trips over one TCP connection
                    with gRPC's 5-byte message prefix and no HTTP/2, each side one thread
                    blocking in ``recv`` (no gRPC, not a wire format the package speaks), with
                    100-byte records and with 344,000-byte ones (a pass of 16 pixel records);
                    CPU per round trip of each side.

Run with nothing else busy: ``python benchmarks/probe_grpc.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc

_CLIENT = r"""
import grpc, queue, sys
ch = grpc.insecure_channel(sys.argv[1]); grpc.channel_ready_future(ch).result(timeout=10)
q = queue.SimpleQueue(); q.put(b"x" * 100)
for cmd in ch.stream_stream("/s/m")(iter(q.get, None)):
    q.put(b"y" * 100)
"""


_RAW_HOST = r"""
import os, socket, struct, sys, time
hdr = struct.Struct(">BI")
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf, rec = bytearray(1 << 20), os.urandom(int(sys.argv[2]))
def fill(n):
    view, got = memoryview(buf)[:n], 0
    while got < n:
        r = s.recv_into(view[got:], n - got)
        if not r:
            raise EOFError
        got += r
n = 0
try:
    while True:
        fill(5); fill(hdr.unpack_from(buf)[1])
        if len(rec) < 65536:
            s.sendall(hdr.pack(0, len(rec)) + rec)
        else:
            s.sendall(hdr.pack(0, len(rec))); s.sendall(rec)
        n += 1
except (EOFError, ConnectionError):
    pass
print(1e6 * time.process_time() / max(n, 1), flush=True)
"""


def raw_socket(n, size):
    hdr = struct.Struct(">BI")
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    client = subprocess.Popen([sys.executable, "-c", _RAW_HOST, str(ls.getsockname()[1]), str(size)],
                              stdout=subprocess.PIPE, text=True)
    s, _ = ls.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf, cmd = bytearray(1 << 20), b"c" * 100

    def fill(k):
        view, got = memoryview(buf)[:k], 0
        while got < k:
            got += s.recv_into(view[got:], k - got)

    def round_trip():
        s.sendall(hdr.pack(0, len(cmd)) + cmd)
        fill(5)
        fill(hdr.unpack_from(buf)[1])

    for _ in range(200):
        round_trip()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        round_trip()
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    s.close()
    ls.close()
    host_cpu = float(client.communicate(timeout=30)[0])  # its whole life, start-up included, per round trip
    print(f"{'raw socket':12} {1e6 * dt / n:6.0f} us wall, {1e6 * dc / n:6.0f} us CPU per round trip (server), "
          f"{size}-byte records (the client: {host_cpu:.0f} us, its start-up included)", flush=True)


_HOST_CLIENT = r"""
import queue, sys, time
import grpc
from torchrl_asyncpool.remote.host_call import open_host_call
mode, address, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
ch = grpc.insecure_channel(address); grpc.channel_ready_future(ch).result(timeout=10)
if mode == "public":
    q = queue.SimpleQueue()
    responses = ch.stream_stream("/s/m")(iter(q.get, None))
    send, recv = q.put, lambda: next(responses)
else:
    call = open_host_call(ch, "/s/m")
    send, recv = call.send, call.recv
for i in range(n + 200):
    if i == 200:
        t0, c0 = time.perf_counter(), time.process_time()
    send(b"x" * 100)
    recv()
print(1e6 * (time.perf_counter() - t0) / n, 1e6 * (time.process_time() - c0) / n, flush=True)
"""


def host_clients(n):
    srv, port = _echo_server()
    try:
        for mode in ("public", "host call"):
            out = subprocess.run([sys.executable, "-c", _HOST_CLIENT, mode.split()[0], f"127.0.0.1:{port}", str(n)],
                                 capture_output=True, text=True, timeout=300, check=True).stdout
            wall, cpu = (float(x) for x in out.split())
            print(f"{'host client':12} {wall:6.0f} us wall, {cpu:6.0f} us CPU per round trip (client, {mode})",
                  flush=True)
    finally:
        srv.stop(None)


def _echo_server():
    """A threaded gRPC server answering each message of a stream with itself; ``(server, port)``."""
    def echo(reqs, ctx):
        yield from reqs

    srv = grpc.server(futures.ThreadPoolExecutor(4))
    srv.add_generic_rpc_handlers(_handlers(echo))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    return srv, port


def _handlers(fn):
    return (grpc.method_handlers_generic_handler("s", {"m": grpc.stream_stream_rpc_method_handler(fn)}),)


def _report(label, n, t0, c0, what):
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    print(f"{label:12} {1e6 * dt / n:6.0f} us wall, {1e6 * dc / n:6.0f} us CPU per round trip ({what})", flush=True)


def pingpong(n):
    srv, port = _echo_server()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    q = queue.SimpleQueue()
    resp = ch.stream_stream("/s/m")(iter(q.get, None))
    q.put(b"x" * 100)
    next(resp)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        q.put(b"x" * 100)
        next(resp)
    _report("pingpong", n, t0, c0, "client and server")
    q.put(None)
    ch.close()
    srv.stop(None)


def sync_bridge(n):
    got = queue.SimpleQueue()

    def handler(reqs, ctx):
        out = queue.SimpleQueue()
        got.put((reqs, out))
        yield from iter(out.get, None)

    srv = grpc.server(futures.ThreadPoolExecutor(4))
    srv.add_generic_rpc_handlers(_handlers(handler))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    client = subprocess.Popen([sys.executable, "-c", _CLIENT, f"127.0.0.1:{port}"])
    try:
        reqs, out = got.get()
        next(reqs)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            out.put(b"c")
            next(reqs)
        _report("sync bridge", n, t0, c0, "server")
        out.put(None)
    finally:
        client.kill()
        client.wait()
        srv.stop(None)


def aio_bridge(n):
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    got = queue.SimpleQueue()

    async def handler(reqs, ctx):
        await ctx.read()
        done = asyncio.Event()
        got.put((ctx, done))
        await done.wait()

    async def exchange(ctx, cmd):
        await ctx.write(cmd)
        return await ctx.read()

    async def start():
        srv = grpc.aio.server()
        srv.add_generic_rpc_handlers(_handlers(handler))
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        return srv, port

    srv, port = asyncio.run_coroutine_threadsafe(start(), loop).result()
    client = subprocess.Popen([sys.executable, "-c", _CLIENT, f"127.0.0.1:{port}"])
    try:
        ctx, done = got.get()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            asyncio.run_coroutine_threadsafe(exchange(ctx, b"c"), loop).result()
        _report("aio bridge", n, t0, c0, "server")
        loop.call_soon_threadsafe(done.set)
    finally:
        client.kill()
        client.wait()
        asyncio.run_coroutine_threadsafe(srv.stop(None), loop).result()
        loop.call_soon_threadsafe(loop.stop)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.repeats):
        pingpong(args.records)
        sync_bridge(args.records)
        aio_bridge(args.records)
        host_clients(args.records)
        raw_socket(args.records, 100)
        raw_socket(args.records, 344_000)


if __name__ == "__main__":
    main()
