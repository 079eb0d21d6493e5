"""What HTTP/2 would cost the router per request: the server side of the pure-Python ``h2`` library.

One in-memory connection, a browser-like request (HPACK headers, a cookie) and a 100-byte JSON
answer (HEADERS + DATA, then the client's WINDOW_UPDATE): only the server's calls are timed, with
``time.process_time``, so the figure is CPU per request however busy the machine is. It is the
protocol alone, before any proxying. ``h2`` is not a dependency of lchat: run it from a venv that
has it (``python -m venv /tmp/h2 && /tmp/h2/bin/pip install h2 && /tmp/h2/bin/python
bench/h2cost.py``). docs/performance.md "HTTP/2: not offered, on purpose" records the figure.
"""

import time

import h2.config  # type: ignore[import-not-found]
import h2.connection  # type: ignore[import-not-found]
import h2.events  # type: ignore[import-not-found]


def run(n: int) -> float:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    headers = [
        (":method", "GET"),
        (":path", "/api/messages?since=123"),
        (":scheme", "https"),
        (":authority", "space.example.com"),
        ("user-agent", "Mozilla/5.0 (X11; Linux x86_64) Chrome/120"),
        ("accept", "application/json"),
        ("accept-encoding", "gzip, deflate, br"),
        ("accept-language", "en-GB,en;q=0.9"),
        ("cookie", "session=" + "a" * 40),
    ]
    body = b"x" * 100
    server_cpu = 0.0
    for _ in range(n):
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, headers, end_stream=True)
        wire = client.data_to_send()
        t = time.process_time()
        for ev in server.receive_data(wire):
            if isinstance(ev, h2.events.RequestReceived):
                server.send_headers(
                    ev.stream_id,
                    [
                        (":status", "200"),
                        ("content-type", "application/json"),
                        ("content-length", "100"),
                    ],
                )
                server.send_data(ev.stream_id, body, end_stream=True)
        out = server.data_to_send()
        server_cpu += time.process_time() - t
        for ev in client.receive_data(out):
            if isinstance(ev, h2.events.DataReceived):
                client.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        ack = client.data_to_send()
        t = time.process_time()
        server.receive_data(ack)
        server.data_to_send()
        server_cpu += time.process_time() - t
    return server_cpu / n * 1e6


if __name__ == "__main__":
    runs = sorted(run(20000) for _ in range(5))
    print(
        f"h2 {h2.__version__}: server CPU per request, median of 5 x 20000: {runs[2]:.1f} us (min {runs[0]:.1f}, max {runs[-1]:.1f}); load {open('/proc/loadavg').read().split()[0]}"
    )
