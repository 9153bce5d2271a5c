#!/usr/bin/env python3
# spec/support/raw_http.py — one raw HTTP/1.1 exchange for the framing specs (run by
# spec/support/raw_http.lua): connects to HOST PORT on loopback (over TLS when a CA file is
# given, checking the certificate against it for "localhost"), sends stdin's bytes exactly as
# they are (NULs, bare LFs, folded lines and all), then reads until the server closes the
# connection or stays silent for IDLE seconds. stdout: the bytes received; exit status 0 when
# the server closed the connection, 3 when it was still open at the end.
import socket
import ssl
import sys

host, port, idle = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ca = sys.argv[4] if len(sys.argv) > 4 else None
data = sys.stdin.buffer.read()
sock = socket.create_connection((host, port), timeout=10)
if ca:
    ctx = ssl.create_default_context(cafile=ca)
    ctx.set_alpn_protocols(["http/1.1"])
    sock = ctx.wrap_socket(sock, server_hostname="localhost")
sock.sendall(data)
sock.settimeout(idle)
got = bytearray()
closed = False
try:
    while True:
        b = sock.recv(65536)
        if not b:
            closed = True
            break
        got += b
except socket.timeout:
    pass
except (ConnectionResetError, ssl.SSLError):
    closed = True
sys.stdout.buffer.write(bytes(got))
sys.stdout.flush()
sys.exit(0 if closed else 3)
