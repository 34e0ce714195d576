"""A producer SIGKILLed before token 0: the router places the request again on the other
producer, and the client gets the colocated engine's tokens, not an error."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from cluster_client import generate, stub_for, wait_for_full_kv
from live_cluster import start_cluster
from pdserve.v1 import common_pb2, router_pb2

from engine.sampling_params import SamplingParams

FILLER = ("Serving large language models efficiently means separating the compute-bound "
          "prompt phase from the memory-bound generation phase. ")


def _listed(stub, rid: str):  # type: ignore[no-untyped-def]
    st = stub.ClusterStatus(router_pb2.ClusterStatusRequest(include_requests=True))
    return next((r for r in st.requests if r.request_id == rid), None)


def test_producer_killed_before_token0_completes_on_the_other_producer(tmp_path_factory,
                                                                        colocated_llm):
    c = start_cluster(tmp_path_factory, "cretry", producers=2, consumers=1,
                      router_args=("--heartbeat-timeout", "2"))
    ch, stub = stub_for(c.router_address)
    try:
        tok = colocated_llm.tokenizer
        # many 128-token chunks: the kill lands while worker-0 is still prefilling (PAIRED:
        # the consumer reserved, token 0 not yet out)
        prompt = tok.encode_chat([{"role": "user", "content": FILLER * 40 + "Summarize."}])
        sampling = dict(max_tokens=12, temperature=0.0)
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(generate, stub, sampling, timeout=300, request_id="retry-me",
                              prompt_token_ids=router_pb2.TokenIds(ids=prompt))
            end = time.monotonic() + 60
            while True:  # round robin: the first request goes to worker-0
                seen = _listed(stub, "retry-me")
                if seen is not None and seen.state == "PAIRED":
                    break
                assert not fut.done(), fut.result()
                assert time.monotonic() < end, seen
                time.sleep(0.01)
            assert seen.producer == "worker-0" and seen.tokens_streamed == 0, seen
            c.kill("worker-0")
            r = fut.result()
        assert r.code is None and r.error == "", (r.code, r.details, r.error)
        assert r.timing.producer == "worker-1" and r.timing.consumer == "worker-2"
        ref = colocated_llm.generate([prompt], [SamplingParams(**sampling)])[0]
        assert r.token_ids == ref.token_ids and r.text == ref.text
        assert r.finish_reason == {"stop": common_pb2.FINISH_REASON_STOP,
                                   "length": common_pb2.FINISH_REASON_LENGTH}[ref.finish_reason]
        assert r.usage.completion_tokens == len(ref.token_ids)
        # the aborted first reservation and the retry's blocks all came back
        workers = wait_for_full_kv(stub, timeout=30)
        assert {w.worker_id for w in workers} == {"worker-1", "worker-2"}
    finally:
        ch.close()
        c.stop()
