"""Peak RSS of a `rollout serve --websocket-deflate` process under a deflate bomb (issue 29).

N sockets each negotiate permessage-deflate, then send one text message, unfinished (FIN
clear), whose compressed frames (`--compressed` KB in all, default 122) would inflate to
~1,000 times that; the script samples the server's RSS every 10 ms until every socket is
closed by the server (or `--hold` seconds pass) and prints the baseline and the peak.

    python bench/scripts/deflate_bomb.py [--sockets 40] [--compressed 122] [-- SERVER ARGS]
"""

from __future__ import annotations

import argparse
import base64
import os
import socket
import subprocess
import sys
import threading
import time
import zlib


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def frame(opcode: int, payload: bytes, *, fin: bool, rsv1: bool) -> bytes:
    mask = os.urandom(4)
    first = (0x80 if fin else 0) | (0x40 if rsv1 else 0) | opcode
    size = len(payload)
    if size < 126:
        head = bytes([first, 0x80 | size])
    elif size < 65536:
        head = bytes([first, 0x80 | 126]) + size.to_bytes(2, "big")
    else:
        head = bytes([first, 0x80 | 127]) + size.to_bytes(8, "big")
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return head + mask + masked


def bomb(compressed_kb: int) -> list[bytes]:
    """Frames of one unfinished text message: the first (RSV1, text) and continuations, each
    ~16 KB of deflate over a run of spaces."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = b" " * (1 << 24)
    out: list[bytes] = []
    total = 0
    first = True
    while total < compressed_kb * 1024:
        data = deflate.compress(chunk) + deflate.flush(zlib.Z_SYNC_FLUSH)
        out.append(frame(0x1 if first else 0x0, data, fin=False, rsv1=first))
        first = False
        total += len(data)
    return out


def handshake(port: int, key: str | None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    nonce = base64.b64encode(os.urandom(16)).decode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock.sendall(
        (
            "GET /v1/responses HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {nonce}\r\nSec-WebSocket-Version: 13\r\n"
            f"Sec-WebSocket-Extensions: permessage-deflate\r\n{auth}\r\n"
        ).encode()
    )
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(1)
    assert answer.startswith(b"HTTP/1.1 101"), answer
    assert b"permessage-deflate" in answer.lower(), answer
    return sock


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sockets", type=int, default=40)
    parser.add_argument("--compressed", type=int, default=122, help="KB per socket")
    parser.add_argument("--port", type=int, default=8741)
    parser.add_argument("--hold", type=float, default=20.0)
    parser.add_argument("server_args", nargs="*")
    args = parser.parse_args()
    server = subprocess.Popen(
        [
            *os.environ.get("BOMB_SERVER", f"{sys.executable} -m rollout").split(),
            "serve",
            "--port",
            str(args.port),
            "--data-dir",
            f"/tmp/deflate-bomb-{os.getpid()}",
            "--websocket-deflate",
            "--websocket-ping-interval",
            "inf",
            *args.server_args,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert server.stderr is not None
    for line in server.stderr:
        if "serving on" in line:
            break
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(server.stderr), daemon=True).start()  # type: ignore[arg-type]
    try:
        time.sleep(0.5)
        base = rss(server.pid)
        frames = bomb(args.compressed)
        peak = base
        closes: dict[int, bytes] = {}
        socks = [handshake(args.port, None) for _ in range(args.sockets)]
        sent = 0

        def send(i: int, sock: socket.socket) -> None:
            nonlocal sent
            try:
                for f in frames:
                    sock.sendall(f)
                    sent += len(f)
            except OSError:
                pass
            try:
                sock.settimeout(args.hold)
                closes[i] = sock.recv(64)
            except OSError as exc:
                closes[i] = repr(exc).encode()

        threads = [threading.Thread(target=send, args=(i, s)) for i, s in enumerate(socks)]
        start = time.monotonic()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads) and time.monotonic() - start < args.hold:
            peak = max(peak, rss(server.pid))
            time.sleep(0.01)
        took = time.monotonic() - start
        codes: dict[str, int] = {}
        for data in closes.values():
            code = (
                str(int.from_bytes(data[2:4], "big"))
                if len(data) >= 4 and data[0] == 0x88
                else data[:30].decode("latin-1")
            )
            codes[code] = codes.get(code, 0) + 1
        print(
            f"sockets {args.sockets}, {sent / 1e6:.1f} MB sent; RSS baseline "
            f"{base / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB; after {took:.1f} s: "
            f"closes {codes}; after: {rss(server.pid) / 2**20:.0f} MiB"
        )
    finally:
        server.terminate()
        server.wait(timeout=20)
    bad = [line for line in lines if "Traceback" in line or "unexpected" in line]
    print("log problems:", len(bad), bad[:3])
    return 0


if __name__ == "__main__":
    sys.exit(main())
