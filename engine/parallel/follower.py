"""A follower rank of a tensor-parallel engine: `python -m engine.parallel.follower ARGS`.

Joins the group, loads its weight shard, allocates its KV (its heads only), then replays
rank 0's step plans until told to stop or rank 0 goes away (its channel closes, or a
collective fails): in every case it exits, so a dead rank 0 leaves no follower behind.
See engine.parallel.followers for the whole lifecycle. A rank side (engine.parallel.
rank_side), when rank 0 attaches one, gets the side messages in plan order and is polled
between them.
"""

from __future__ import annotations

import json
import os
import select
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from engine import host_memory
from engine.attention import kernels_for
from engine.decode_graphs import DecodeGraphs
from engine.kv_scales import apply_kv_scales
from engine.parallel.block_copy import broadcast_blocks
from engine.parallel.dp_groups import make_attention_group
from engine.parallel.dp_plan import DPPlan, run_dp_plan
from engine.parallel.graph_step import GraphStep, apply_graph_step
from engine.parallel.group import TPGroup, host_staged
from engine.parallel.messages import (
    TO_FOLLOWER,
    Attach,
    Attached,
    AttachFailed,
    GraphsReady,
    GraphsStart,
    Hello,
    KvCopy,
    KvReady,
    KvStart,
    SideMessage,
    SideReport,
    Stop,
)
from engine.parallel.rank_side import RankSide, attach
from engine.parallel.step_plan import StepPlan, run_plan
from engine.parallel.wire import read_frame, write_frame
from engine.weights import build_model, read_model_config


def main(argv: list[str]) -> int:
    a = json.loads(argv[0])
    cfg = a["config"]
    torch.set_num_threads(a["threads"])
    chan, stdin = a["chan_fd"], sys.stdin.fileno()
    device = torch.device(a["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    write_frame(chan, Hello())
    _exit_with_parent()
    store = dist.TCPStore("127.0.0.1", a["port"], a["size"], False,
                          timeout=_td(cfg["tp_timeout_s"]))
    group_store = dist.PrefixStore(a["prefix"], store)
    group = TPGroup(group_store, a["rank"], a["size"], device, cfg["tp_timeout_s"],
                    host_staged(cfg["extra"]))
    model_group: TPGroup = group
    if cfg["data_parallel_size"] > 1:  # the model's attention group, its experts over all
        model_group = make_attention_group(group, group_store, a["size"],
                                           cfg["data_parallel_size"])
    model_cfg = read_model_config(a["model_path"])
    kernels = kernels_for(device, force_reference=bool(cfg["extra"].get("reference_kernels")))
    max_len = cfg["max_model_len"] or min(model_cfg.max_position_embeddings, 8192)
    model = build_model(a["model_path"], model_cfg, kernels, device, cfg["dtype"],
                        cfg["load_format"], max_positions=max(max_len, 1), seed=cfg["seed"],
                        group=model_group, quantization=cfg.get("quantization"))
    msg = read_frame(stdin, TO_FOLLOWER)
    if isinstance(msg, Stop):
        return 0
    if not isinstance(msg, KvStart):
        raise ValueError(f"follower rank {a['rank']}: expected {KvStart.KIND!r}, got "
                         f"{msg.KIND!r}")
    shape, dtype = msg.shape, msg.dtype
    apply_kv_scales(model, msg.kv_scales)  # rank 0's, so every rank stores the same numbers
    # on CPU the same huge-page pool as rank 0's (a transfer endpoint may share it)
    kv_cache = (host_memory.zeros(shape, getattr(torch, dtype)) if device.type == "cpu"
                else torch.zeros(shape, dtype=getattr(torch, dtype), device=device))
    write_frame(chan, KvReady())
    follow(model, kv_cache, group, stdin, device, chan, model_group)
    return 0


SIDE_POLL_S = 0.003  # how often an attached rank side is polled while no message comes


@torch.inference_mode()
def follow(model: torch.nn.Module, kv_cache: torch.Tensor, group: TPGroup, fd: int,
           device: torch.device, chan: int, attn_group: TPGroup | None = None) -> None:
    """attn_group: this rank's attention group (data-parallel attention), which block
    copies run over; the whole TP group without."""
    prev_ids: torch.Tensor | None = None
    side: RankSide | None = None
    graphs: DecodeGraphs | None = None  # rank 0's decode graphs, replayed in step with it
    try:
        while True:
            if side is not None:
                for report in side.poll():
                    write_frame(chan, SideReport(report))
                if not select.select([fd], [], [], SIDE_POLL_S)[0]:
                    continue
            try:
                msg = read_frame(fd, TO_FOLLOWER)
            except EOFError:
                return  # rank 0 is gone
            if isinstance(msg, Stop):
                return
            if isinstance(msg, GraphStep):
                assert graphs is not None, "a graph step before the graphs were built"
                prev_ids = apply_graph_step(graphs, msg, prev_ids, group, device)
            elif isinstance(msg, DPPlan):
                run_dp_plan(model, kv_cache, msg, prev_ids, group, device)  # type: ignore[arg-type]
                prev_ids = None
                if msg.num_sampled:  # rank 0 sampled every group's rows
                    prev_ids = group.broadcast(
                        torch.empty(msg.num_sampled, dtype=torch.int64, device=device), 0)
            elif isinstance(msg, StepPlan):
                run_plan(model, kv_cache, msg, prev_ids, device)  # type: ignore[arg-type]
                prev_ids = None
                if msg.sample_at:  # rank 0 sampled: keep its ids for the next step's inputs
                    prev_ids = group.broadcast(
                        torch.empty(len(msg.sample_at), dtype=torch.int64, device=device), 0)
            elif isinstance(msg, GraphsStart):
                graphs = DecodeGraphs(model, kv_cache, msg.max_batch,  # type: ignore[arg-type]
                                      msg.max_blocks, device, use_graphs=msg.use_graphs)
                graphs.capture()
                write_frame(chan, GraphsReady())
            elif isinstance(msg, KvCopy):
                broadcast_blocks(attn_group or group, kv_cache, msg.block_ids)
            elif isinstance(msg, SideMessage) and side is not None:
                side.on_message(msg.body)
            elif isinstance(msg, Attach):
                try:
                    # its views of the pool are written by transfer threads, which run
                    # outside inference mode: they must not be inference tensors
                    with torch.inference_mode(False):
                        side = attach(msg.factory, kv_cache, group.rank, group.size, msg.args)
                    write_frame(chan, Attached(side.info()))
                except Exception as e:  # noqa: BLE001 - rank 0 raises it, naming this rank
                    write_frame(chan, AttachFailed(f"{type(e).__name__}: {e}"))
            else:
                raise ValueError(f"follower rank {group.rank}: unexpected {msg.KIND!r} message")
    finally:
        if side is not None:
            side.close()


def _exit_with_parent() -> None:
    """A thread that ends this process when rank 0's process is gone. The main loop notices
    a closed channel only between steps; a collective captured in a CUDA graph waits for
    rank 0 without any timeout, and the process must not outlive it holding the GPU."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def _td(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
