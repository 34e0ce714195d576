"""FP8 checkpoints written by the tests themselves from a float HF model directory, in each
format the engine reads, plus the float checkpoint of the same dequantized weights.

The quantization here is the tests' own (amax / 448 per tensor, row or 128 x 128 block),
independent of the engine's quantizer."""

from __future__ import annotations

import json
import os
import shutil

import torch

FP8 = torch.float8_e4m3fn
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# DeepSeek's MLA projections, FP8 in its checkpoints too
MLA_PROJ = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
FORMATS = ("fp8_block", "ct_channel", "ct_tensor_static", "ct_weight_only")


def _scales(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Per-element dequantization scales of w [N, K] under `fmt` (same shape as w)."""
    n, k = w.shape
    if fmt == "fp8_block":
        out = torch.empty(n, k)
        for i in range(0, n, 128):
            for j in range(0, k, 128):
                out[i:i + 128, j:j + 128] = w[i:i + 128, j:j + 128].abs().max() / 448
        return out
    if fmt == "ct_tensor_static":
        return (w.abs().max() / 448).expand(n, k)
    return (w.abs().amax(dim=1, keepdim=True) / 448).expand(n, k)


def _stored_scale(per_elem: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "fp8_block":
        return per_elem[::128, ::128].contiguous()  # [ceil(N/128), ceil(K/128)]
    if fmt == "ct_tensor_static":
        return per_elem[:1, 0].contiguous()  # [1]
    return per_elem[:, :1].contiguous()  # [N, 1]


def quant_config(fmt: str) -> dict:
    if fmt == "fp8_block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "tensor" if fmt == "ct_tensor_static" else "channel"}
    acts = {"ct_channel": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                           "strategy": "token"},
            "ct_tensor_static": {"num_bits": 8, "type": "float", "symmetric": True,
                                 "dynamic": False, "strategy": "tensor"},
            "ct_weight_only": None}[fmt]
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts,
                                          "output_activations": None}}}


def write_fp8(src: str, fp8_dir: str, deq_dir: str, fmt: str,
              input_scale: float = 0.05, proj: tuple[str, ...] = PROJ) -> tuple[str, str]:
    """Writes `src`'s model as an FP8 checkpoint of `fmt` into fp8_dir, and the same
    (dequantized) weights as a float32 checkpoint into deq_dir; returns both paths.
    proj: the projections quantized (by module name; MLA_PROJ adds DeepSeek's)."""
    from safetensors.torch import load_file, save_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    fp8: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not (name.endswith(".weight") and name.split(".")[-2] in proj):
            fp8[name] = deq[name] = t.float().contiguous()
            continue
        w = t.float()
        scale = _scales(w, fmt).clamp_min(1e-12)
        q = (w / scale).clamp(-448, 448).to(FP8)
        fp8[name] = q
        base = name[: -len(".weight")]
        key = ".weight_scale_inv" if fmt == "fp8_block" else ".weight_scale"
        fp8[base + key] = _stored_scale(scale, fmt)
        if fmt == "ct_tensor_static":
            fp8[base + ".input_scale"] = torch.tensor([input_scale])
        deq[name] = (q.float() * scale).contiguous()
    for d, ts in ((fp8_dir, fp8), (deq_dir, deq)):
        os.makedirs(d, exist_ok=True)
        save_file(ts, os.path.join(d, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(deq_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump({**cfg, "quantization_config": quant_config(fmt)}, f)
    for extra in ("generation_config.json", "tokenizer.json"):
        if os.path.exists(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), fp8_dir)
            shutil.copy(os.path.join(src, extra), deq_dir)
    return fp8_dir, deq_dir


def engine_logits(path: str, prompt: list[int], dtype: str = "float32",
                  quantization: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill logits [len(prompt) - 1, V], decode logits [1, V]) of the engine's model on
    CPU: all but the last token in one prefill (many rows: FP8 x FP8 on a GPU, activation
    quantization simulated on CPU), then the last token as a one-row decode (weight-only)."""
    from engine.attention import AttentionMetadata, kernels_for
    from engine.weights import build_model, read_model_config

    cfg = read_model_config(path)
    cpu = torch.device("cpu")
    model = build_model(path, cfg, kernels_for(cpu), cpu, dtype, "auto", 512,
                        quantization=quantization)
    bs = 4
    nb = -(-len(prompt) // bs)
    kv = torch.zeros(nb + 1, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim,
                     dtype=getattr(torch, dtype))
    table = torch.tensor([list(range(1, nb + 1))], dtype=torch.int32)
    out = []
    for start, end in ((0, len(prompt) - 1), (len(prompt) - 1, len(prompt))):
        pos = torch.arange(start, end)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([(1 + p // bs) * bs + p % bs for p in pos.tolist()]),
            block_tables=table, cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32), decode_only=end - start == 1,
            max_seq_len=end, cu_seqlens_q_host=[0, end - start], seq_lens_host=[end])
        with torch.inference_mode():
            out.append(model.compute_logits(model(torch.tensor(prompt[start:end]), pos, kv,
                                                  meta)).float())
    return out[0], out[1]


def mse_rows_round_trip(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] through FP8 with each row's scale the one of amax / 448 * s, s = 1.0, 0.98,
    ..., 0.5, that leaves the least squared error (the first of equal ones): the rule of
    ``--quantization fp8``, written out row by row here."""
    out = torch.empty_like(w)
    for i, row in enumerate(w):
        amax = (row.abs().max() / 448).clamp_min(1e-12)  # float32, as the engine's
        best = None
        for j in range(26):
            scale = amax * round(1.0 - 0.02 * j, 2)
            rt = (row / scale).clamp(-448, 448).to(FP8).float() * scale
            err = float((rt - row).square().sum())
            if best is None or err < best[0]:
                best = (err, rt)
        assert best is not None
        out[i] = best[1]
    return out


def write_rows_dequantized(src: str, dst: str, quantized) -> str:  # type: ignore[no-untyped-def]
    """Writes `src`'s model into dst with each weight `quantized(name)` selects replaced by
    its per-row FP8 round trip under ``--quantization fp8``'s rule (mse_rows_round_trip),
    in float32: the float model of what the engine holds after quantizing at load."""
    from safetensors.torch import load_file, save_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    out = {}
    for name, t in tensors.items():
        w = t.float()
        if quantized(name):
            w = mse_rows_round_trip(w)
        out[name] = w.contiguous()
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"))
    for extra in ("config.json", "generation_config.json", "tokenizer.json"):
        if os.path.exists(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), dst)
    return dst


def teacher_forced_agreement(llm, prompts: list[list[int]],  # type: ignore[no-untyped-def]
                             ref: list[list[int]]) -> int:
    """How many of the reference's greedy tokens `llm` picks itself when given the
    reference's own prefix before each of them. Free-running agreement cannot judge FP8
    on the tests' tiny random models: their logits are nearly flat, so one rounding-level
    near-tie flips a token and every later token differs with it (bf16 against float32 of
    the same weights already diverges within a few tokens). Given the same prefixes, a
    correct FP8 path keeps most positions and a broken kernel almost none."""
    from engine.sampling_params import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    same = 0
    for i in range(len(ref[0])):
        outs = llm.generate([p + r[:i] for p, r in zip(prompts, ref, strict=True)], one)
        same += sum(o.token_ids[0] == r[i] for o, r in zip(outs, ref, strict=True))
    return same
