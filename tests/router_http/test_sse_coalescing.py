"""Several tokens of one request waiting when the SSE stream's writer runs leave as one
chunk: the same text, in order, over the real HTTP path (router server, fake workers whose
Outputs batch carries a burst of one request's tokens together). As on the gRPC door, the
burst's first token may be written straight from the batch (nothing waits yet); the rest
wait behind that write and leave merged."""

from __future__ import annotations

import json

import aiohttp
from router_fakes import BURST, BURSTS, Cluster, burst_text, decode_bursts, run


def test_sse_chunk_carries_every_token_that_waited() -> None:
    async def main() -> None:
        async with Cluster(http_port=0) as cl:
            await cl.pd(decode=decode_bursts)
            cl.workers[1].outputs = cl.workers[1].batch_all = True
            url = f"http://127.0.0.1:{cl.server.http_port}/v1/completions"
            async with aiohttp.ClientSession() as s, s.post(url, json={
                    "prompt": "x", "stream": True, "max_tokens": BURSTS * BURST + 1,
                    "stream_options": {"include_usage": True}}) as r:
                assert r.status == 200
                body = await r.text()
        events = [ln[6:] for ln in body.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
        assert "".join(texts) == burst_text()
        assert chunks[-1]["usage"]["completion_tokens"] == BURSTS * BURST + 1
        # token 0's chunk, then at most two chunks a burst (one written direct, nine merged)
        assert len(texts) <= 1 + 2 * BURSTS, texts
        assert max(len(t) for t in texts) >= len("<11>") * (BURST - 1), texts

    run(main(), timeout=60)
