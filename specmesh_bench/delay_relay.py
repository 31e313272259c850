"""A TCP relay that holds every byte for a fixed one-way delay, in each direction: link latency where the kernel has
no netem qdisc (the split-host benchmark's fallback, `--link-delay relay`).

Each route listens on LISTEN_HOST:PORT and forwards every connection to TARGET_HOST:PORT. What is read at time t is
written at t + delay, in order, so a request/response exchange over it gains twice the delay, as over a link whose
one-way latency is the delay. Unlike netem it does not delay TCP's own acknowledgements (no effect on the small
messages of gRPC unary calls once the connection is up). Prints `RELAYING` once every route listens.

    python -m specmesh_bench.delay_relay --delay-ms 5 --route 10.0.0.254:50052=10.0.0.11:50052
"""

from __future__ import annotations

import argparse
import asyncio
import sys

CHUNK = 1 << 16


def route(text: str) -> tuple[str, int, str, int]:
    try:
        listen, target = text.split("=")
        lhost, lport = listen.rsplit(":", 1)
        thost, tport = target.rsplit(":", 1)
        return lhost, int(lport), thost, int(tport)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LISTEN_HOST:PORT=TARGET_HOST:PORT, got {text!r}") from None


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy reader to writer, each chunk written `delay_s` after it was read; reading never waits for writing."""
    loop = asyncio.get_running_loop()
    held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await held.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    delivering = asyncio.ensure_future(deliver())
    try:
        while data := await reader.read(CHUNK):
            held.put_nowait((loop.time() + delay_s, data))
    except ConnectionError:
        pass
    finally:
        held.put_nowait((loop.time() + delay_s, b""))
    try:
        await delivering
    except ConnectionError:
        pass


async def relay(delay_s: float, target_host: str, target_port: int, client_reader: asyncio.StreamReader,
                client_writer: asyncio.StreamWriter) -> None:
    try:
        server_reader, server_writer = await asyncio.open_connection(target_host, target_port)
    except OSError:
        client_writer.close()
        return
    try:
        await asyncio.gather(pump(client_reader, server_writer, delay_s), pump(server_reader, client_writer, delay_s))
    finally:
        for w in (client_writer, server_writer):
            w.close()


async def serve(routes: list[tuple[str, int, str, int]], delay_s: float) -> None:
    servers = []
    for lhost, lport, thost, tport in routes:
        async def handle(r, w, thost=thost, tport=tport) -> None:
            await relay(delay_s, thost, tport, r, w)
        servers.append(await asyncio.start_server(handle, lhost, lport))
    print("RELAYING", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay added to every byte, ms")
    parser.add_argument("--route", type=route, action="append", required=True,
                        help="LISTEN_HOST:PORT=TARGET_HOST:PORT (repeatable)")
    args = parser.parse_args(argv)
    if args.delay_ms < 0:
        parser.error("--delay-ms must be >= 0")
    try:
        asyncio.run(serve(args.route, args.delay_ms / 1000.0))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
