"""How a scrape is read: the scrapers' HTTP/1.1 client (``shared.adapters.httpclient.HttpClient``) and the small
server's keep-alive, over real sockets (one connection reused scrape after scrape, a connection the server closed while
idle replaced without an error, every body framing an exporter may use, clear errors for the rest), and the
parser's per-source page plan, which must never read a page differently from a full parse."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from shared.adapters.exposition import ExpositionParser
from shared.adapters.httpclient import HttpClient
from shared.plumbing.http import SmallHttpServer
from shared.ports.metrics import MetricsSourceError
from tests.helpers import eventually

Raw = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    request = await reader.readline()
    while await reader.readline() not in (b"\r\n", b""):
        pass
    return request


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[Raw], Awaitable[str]]]:
    """A server whose answers the test writes byte by byte; returns its URL."""
    servers: list[asyncio.Server] = []

    async def start(handler: Raw) -> str:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/metrics"

    yield start
    for server in servers:
        server.close()


async def test_one_connection_serves_every_scrape() -> None:
    calls = 0

    async def route(method: str, path: str) -> tuple[str, str, bytes]:
        nonlocal calls
        calls += 1
        return "200 OK", "text/plain", f"page {calls}".encode()

    server = SmallHttpServer(route)
    port = await server.start("127.0.0.1", 0)
    client = HttpClient(f"http://127.0.0.1:{port}/metrics", timeout=5)
    try:
        bodies = [await client.get() for _ in range(5)]
    finally:
        client.close()
        await server.stop()
    assert bodies == [(200, f"page {i}".encode()) for i in range(1, 6)]
    assert client.connections == 1


async def test_a_connection_closed_while_idle_is_replaced_without_an_error() -> None:
    async def route(method: str, path: str) -> tuple[str, str, bytes]:
        return "200 OK", "text/plain", b"ok"

    server = SmallHttpServer(route, idle_s=0.05)  # closes a connection idle for 50 ms
    port = await server.start("127.0.0.1", 0)
    client = HttpClient(f"http://127.0.0.1:{port}/metrics", timeout=5)
    try:
        assert await client.get() == (200, b"ok")
        conn = client._conn
        assert conn is not None
        await eventually(lambda: conn.closed, timeout=5)
        assert await client.get() == (200, b"ok")
    finally:
        client.close()
        await server.stop()
    assert client.connections == 2


async def test_chunked_answers_with_trailers_and_close_delimited_answers(
    raw_server: Callable[[Raw], Awaitable[str]],
) -> None:
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):  # two requests on one connection, as Go's net/http serves an unsized page
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/plain\r\n\r\n")
            for piece in (b"DCGM_FI_DEV_GPU_UTIL", b'{UUID="GPU-1"} ', b"42\n"):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            writer.write(b"0\r\nX-Trailer: yes\r\n\r\n")
            await writer.drain()
        writer.close()

    client = HttpClient(await raw_server(chunked), timeout=5)
    try:
        for _ in range(2):
            assert await client.get() == (200, b'DCGM_FI_DEV_GPU_UTIL{UUID="GPU-1"} 42\n')
    finally:
        client.close()
    assert client.connections == 1

    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nno length, ends with the connection")
        await writer.drain()
        writer.close()

    client = HttpClient(await raw_server(until_close), timeout=5)
    try:
        assert await client.get() == (200, b"no length, ends with the connection")
        assert await client.get() == (200, b"no length, ends with the connection")
    finally:
        client.close()
    assert client.connections == 2


async def test_broken_answers_are_clear_errors(raw_server: Callable[[Raw], Awaitable[str]]) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await writer.drain()
        writer.close()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    for handler, timeout, message in (
        (cut, 5.0, "closed mid-answer"),
        (silent, 0.2, "no complete answer within 0.2s"),
        (garbage, 5.0, "not an HTTP response"),
    ):
        client = HttpClient(await raw_server(handler), timeout=timeout)
        with pytest.raises(MetricsSourceError, match=message):
            await client.get()
        assert client._conn is None  # nothing half-read is reused
    with pytest.raises(MetricsSourceError, match="expected an http"):
        HttpClient("ftp://example/metrics", 1)


def test_a_page_laid_out_as_before_reads_the_same_as_a_full_parse() -> None:
    """The per-source plan: same layout, new numbers -> the same readings as the line-by-line parse; a changed
    label, a NaN or a malformed number -> the full parse, which reports them."""

    def page(util: str, pod: str = "llama-0") -> str:
        labels = f'gpu="0",UUID="GPU-a",Hostname="n1",modelName="H100",pod="{pod}",namespace="llm"'
        return (
            "# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n"
            f"DCGM_FI_DEV_GPU_UTIL{{{labels}}} {util}\n"
            "# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).\n# TYPE DCGM_FI_DEV_FB_USED gauge\n"
            f"DCGM_FI_DEV_FB_USED{{{labels}}} 1024\n"
            "# TYPE DCGM_FI_DEV_SM_CLOCK gauge\n"
            f"DCGM_FI_DEV_SM_CLOCK{{{labels}}} 1980\n"
        )

    planned, plain = ExpositionParser(), ExpositionParser()
    planned.parse(page("10"), source="n1")
    for text in (page("55"), page("55", pod="llama-1"), page("NaN"), page("5_5"), page("77")):
        got = planned.parse(text, source="n1", read_at=1.0)
        want = plain.parse(text, read_at=1.0)
        assert [(r.key, r.pod, r.values, r.invalid) for r in got.readings] == [
            (r.key, r.pod, r.values, r.invalid) for r in want.readings
        ]
        assert (got.problems, got.series) == (want.problems, want.series)
    assert planned._pages["n1"].count == 3


_NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-(10**12), 10**12).map(str),
    st.sampled_from(["1e3", "-0", "+5", "0x10", "1_000", "", "12 1700000000000", "NaN", "+Inf", "-Inf", "abc"]),
)


@given(
    st.lists(
        st.tuples(st.sampled_from(["llama-0", "llama-1", "qwen-7d9c8b6f5-abcde"]), _NUMBERS, _NUMBERS),
        min_size=1,
        max_size=6,
    )
)
@hypothesis_settings(max_examples=150, deadline=None)
def test_the_plan_never_reads_a_page_differently_from_a_full_parse(scrapes: list[tuple[str, str, str]]) -> None:
    """Scrape after scrape of one source, with pods replaced and any text where the numbers go: the planned parser,
    one with no memory of the source, and prometheus-client's parser on every line read the same GPUs, values and
    unusable series every time; the first two also report the same lines."""
    planned = ExpositionParser()
    for pod, util, used in scrapes:
        labels = f'gpu="0",UUID="GPU-a",Hostname="n1",pod="{pod}",namespace="llm"'
        text = (
            "# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n"
            f"DCGM_FI_DEV_GPU_UTIL{{{labels}}} {util}\n"
            "# TYPE DCGM_FI_DEV_FB_USED gauge\n"
            f"DCGM_FI_DEV_FB_USED{{{labels}}} {used}\n"
            f'DCGM_FI_DEV_FB_USED{{gpu="1",UUID="GPU-b",Hostname="n1"}} 7\n'
        )
        got = planned.parse(text, source="n1", read_at=1.0)
        want = ExpositionParser().parse(text, read_at=1.0)
        reference = ExpositionParser("reference").parse(text, read_at=1.0)  # prometheus-client on every line
        shape = [(r.key, r.pod, r.values, r.invalid, r.timestamp) for r in got.readings]
        assert shape == [(r.key, r.pod, r.values, r.invalid, r.timestamp) for r in want.readings]
        assert shape == [(r.key, r.pod, r.values, r.invalid, r.timestamp) for r in reference.readings]
        # the same lines are reported (a line seen before is judged by the cached parser, whose words differ)
        assert [_where(p) for p in got.problems] == [_where(p) for p in want.problems]
        assert got.series == want.series


def _where(problem: str) -> str:
    return problem.split(":", 1)[0] if problem.startswith("line ") else problem
