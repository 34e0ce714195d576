"""One P/D request driven by hand, as the router drives it, straight to a producer and a
consumer over gRPC: the consumer reserves (in the attention group the test names), the
producer prefills (in its named group) and pushes to the reserved blocks, the consumer
decodes. Lets a test place requests on exactly the data-parallel groups it wants."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc


@dataclass
class DirectResult:
    token_ids: list[int] = field(default_factory=list)  # token 0 (producer), then 1..n
    kv_address: str = ""  # what the consumer told the producer to push to
    error: str = ""


def pd_request(producer: str, consumer: str, consumer_id: str, rid: str, prompt: list[int],
               sampling: dict, source_tp: int, producer_group: int | None,
               consumer_group: int | None, timeout: float = 120.0) -> DirectResult:
    res = DirectResult()
    sp = common_pb2.SamplingParams(**sampling)
    dreq = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sp,
                                    seed=1, colocated=False, source_tp_size=source_tp)
    if consumer_group is not None:
        dreq.dp_rank = consumer_group
    preq = worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sp,
                                     seed=1)
    if producer_group is not None:
        preq.dp_rank = producer_group
    with grpc.insecure_channel(consumer) as cch, grpc.insecure_channel(producer) as pch:
        decode = worker_pb2_grpc.WorkerStub(cch).Decode(dreq, timeout=timeout)
        try:
            first = next(decode)
            if first.WhichOneof("kind") != "reserved":
                res.error = f"consumer: expected a reservation, got {first}"
                return res
            r = first.reserved
            res.kv_address = r.kv_address
            dest = worker_pb2.KVDestination(consumer_id=consumer_id, kv_address=r.kv_address,
                                            block_ids=r.block_ids,
                                            cached_blocks=r.cached_blocks)

            def inputs() -> Iterator[worker_pb2.PrefillInput]:
                yield worker_pb2.PrefillInput(request=preq)
                yield worker_pb2.PrefillInput(destination=dest)

            for out in worker_pb2_grpc.WorkerStub(pch).Prefill(inputs(), timeout=timeout):
                if out.WhichOneof("kind") == "token0":
                    res.token_ids.append(out.token0.token_id)
                elif out.WhichOneof("kind") == "transfer" and not out.transfer.ok:
                    res.error = f"producer: {out.transfer.error}"
                    return res
            for msg in decode:
                if msg.WhichOneof("kind") == "tokens":
                    res.token_ids += msg.tokens.token_ids
                    res.error += msg.tokens.error
                    if msg.tokens.finish_reason:
                        break
        except grpc.RpcError as e:
            res.error += f"{e.code()}: {e.details()}"
    return res
