#!/usr/bin/env python3
"""Golden reference for upipe's lean AdamW state (--optimizer-state, --master-weights).

usage: make_optimizer_fixtures.py [OUT_DIR]      (default: tests/golden/optim)

An independent reference in NumPy float32, written from the definitions (docs/design.md
section 5, "Lean optimizer state") and from the paper the 8-bit format comes from
(Dettmers, Lewis, Shleifer, Zettlemoyer: "8-bit Optimizers via Block-wise
Quantization", ICLR 2022): AdamW in PyTorch's term order with each product, sum,
quotient and square root rounded to float32 on its own; moments stored as f32, as bf16
(round to nearest even) or as 8-bit codes of the dynamic map in blocks of 256 with an
f32 absmax per block (the step uses the moments before they are encoded); the master
weights in f32, or in bf16 with a bf16 Kahan compensation. NumPy's float32 operations are
IEEE, so the values are the bits the C++ op must give (tests/backend/adamw_modes_test.cpp
holds it to them over six steps).

It writes OUT_DIR/adamw_modes.safetensors (the start, the gradients, and every mode's
state after each step) and OUT_DIR/adamw_modes.json (the hyperparameters, the runs and,
when bitsandbytes imports, the comparison with its AdamW8bit: the maps and six steps on
one parameter, as numbers; bitsandbytes' CPU kernel lets PyTorch fuse multiply-adds, so it
is compared within a tolerance, not bit for bit).
"""
import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parent.parent
SEED = 20261214
N = 1024                 # four q8 blocks
RUNS = [(600, True), (N, False)]   # decay on [0, 600), none after: block 2 spans both
STEPS = 6
BETA1, BETA2, EPS, WD = 0.9, 0.95, 1e-8, 0.1
LRS = [1e-3, 2e-3, 3e-3, 3e-3, 2e-3, 1e-3]
GRAD_SCALES = [1.0, 0.5, 1.0, 0.75, 1.0, 1.0]
BLOCK = 256
F32 = np.float32


def f32(x):
    return np.float32(x)


# ---------------------------------------------------------------------------------------
# Storage formats

def bf16_round(x):
    """float32 -> nearest bf16 (ties to even), as float32."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def dynamic_map(signed):
    """The 256 values of the dynamic map: level e holds 10^(e-6) times the midpoints of
    equal steps of [0.1, 1] (2^e of them signed, with both signs; 2^(e+1) unsigned), then
    0 and 1; each value computed in double and rounded once to float32."""
    values = []
    for level in range(7):
        steps = 2 ** level if signed else 2 ** (level + 1)
        scale = 10.0 ** (level - 6)
        for k in range(steps):
            lo, hi = 0.1 + 0.9 * k / steps, 0.1 + 0.9 * (k + 1) / steps
            values.append(scale * (lo + hi) / 2)
            if signed:
                values.append(-scale * (lo + hi) / 2)
    values += [0.0, 1.0]
    assert len(values) == 256
    code = np.array(sorted(values), dtype=np.float64).astype(np.float32)
    mid = ((code[:-1] + code[1:]) / f32(2)).astype(np.float32)
    return code, mid


SIGNED, UNSIGNED = dynamic_map(True), dynamic_map(False)


def q8_decode(codes, absmax, qmap):
    code, _ = qmap
    return (code[codes].reshape(-1, BLOCK) * absmax.reshape(-1, 1)).reshape(-1).astype(np.float32)


def q8_encode(values, qmap):
    """Per block: the absmax (NaNs never win), then each value times the reciprocal,
    clamped to [-1, 1], to the index of the first midpoint not below it."""
    _, mid = qmap
    blocks = values.reshape(-1, BLOCK)
    absmax = np.abs(blocks).max(axis=1).astype(np.float32)
    inverse = np.where(absmax > 0, f32(1) / np.where(absmax > 0, absmax, f32(1)), f32(0)).astype(np.float32)
    scaled = np.clip((blocks * inverse.reshape(-1, 1)).astype(np.float32), f32(-1), f32(1))
    codes = np.searchsorted(mid, scaled.reshape(-1), side="left").astype(np.uint8)
    return codes, absmax


# ---------------------------------------------------------------------------------------
# AdamW

def coefficients(lr, step, grad_scale):
    lr = float(f32(lr))
    b1, b2 = float(f32(BETA1)), float(f32(BETA2))
    wd = float(f32(WD))
    return dict(beta1=f32(b1), beta2=f32(b2), omb1=f32(1.0 - b1), omb2=f32(1.0 - b2), eps=f32(EPS),
                grad_scale=f32(grad_scale), decay=f32(1.0 - lr * wd), rate=f32(lr * wd),
                step_size=f32(lr / (1.0 - b1 ** step)), bc2=f32(np.sqrt(1.0 - b2 ** step)))


def decays():
    mask = np.zeros(N, dtype=bool)
    begin = 0
    for end, decay in RUNS:
        mask[begin:end] = decay
        begin = end
    return mask


def moments_step(c, m, v, g):
    """The moments in float32 and the step each element takes."""
    grad = (g * c["grad_scale"]).astype(np.float32)
    m = ((c["beta1"] * m).astype(np.float32) + (c["omb1"] * grad).astype(np.float32)).astype(np.float32)
    v = ((c["beta2"] * v).astype(np.float32) + ((c["omb2"] * grad).astype(np.float32) * grad).astype(np.float32))
    v = v.astype(np.float32)
    denom = (np.sqrt(v).astype(np.float32) / c["bc2"]).astype(np.float32) + c["eps"]
    step = ((c["step_size"] * m).astype(np.float32) / denom.astype(np.float32)).astype(np.float32)
    return m, v, step


def master_step(c, master, step, mask):
    decay = np.where(mask, c["decay"], f32(1)).astype(np.float32)
    return ((master * decay).astype(np.float32) - step).astype(np.float32)


def kahan_step(c, w, comp, step, mask):
    rate = np.where(mask, c["rate"], f32(0)).astype(np.float32)
    update = (-(w * rate).astype(np.float32) - step).astype(np.float32)
    y = (comp + update).astype(np.float32)
    nxt = bf16_round((w + y).astype(np.float32))
    taken = (nxt - w).astype(np.float32)
    return nxt, bf16_round((y - taken).astype(np.float32))


def run_mode(moments, master, start, grads):
    """Six steps from a fresh optimizer; the state after each."""
    mask = decays()
    state = {"master": start.copy() if master == "f32" else bf16_round(start)}
    if master == "bf16_kahan":
        state["master_comp"] = np.zeros(N, dtype=np.float32)
    if moments == "q8":
        state["exp_avg"] = np.full(N, 127, dtype=np.uint8)        # the signed map's 0
        state["exp_avg_sq"] = np.zeros(N, dtype=np.uint8)        # the unsigned map's 0
        state["exp_avg_absmax"] = np.zeros(N // BLOCK, dtype=np.float32)
        state["exp_avg_sq_absmax"] = np.zeros(N // BLOCK, dtype=np.float32)
        assert SIGNED[0][127] == 0 and UNSIGNED[0][0] == 0
    else:
        state["exp_avg"] = np.zeros(N, dtype=np.float32)
        state["exp_avg_sq"] = np.zeros(N, dtype=np.float32)
    history = []
    for t in range(STEPS):
        c = coefficients(LRS[t], t + 1, GRAD_SCALES[t])
        if moments == "q8":
            m = q8_decode(state["exp_avg"], state["exp_avg_absmax"], SIGNED)
            v = q8_decode(state["exp_avg_sq"], state["exp_avg_sq_absmax"], UNSIGNED)
        else:
            m, v = state["exp_avg"], state["exp_avg_sq"]
        m, v, step = moments_step(c, m, v, grads[t])
        if moments == "q8":
            state["exp_avg"], state["exp_avg_absmax"] = q8_encode(m, SIGNED)
            state["exp_avg_sq"], state["exp_avg_sq_absmax"] = q8_encode(v, UNSIGNED)
        elif moments == "bf16":
            state["exp_avg"], state["exp_avg_sq"] = bf16_round(m), bf16_round(v)
        else:
            state["exp_avg"], state["exp_avg_sq"] = m, v
        if master == "f32":
            state["master"] = master_step(c, state["master"], step, mask)
        else:
            state["master"], state["master_comp"] = kahan_step(c, state["master"], state["master_comp"], step, mask)
        history.append({k: x.copy() for k, x in state.items()})
    return history


# ---------------------------------------------------------------------------------------
# bitsandbytes

def compare_with_bitsandbytes(rng):
    """AdamW8bit (bitsandbytes' blockwise 8-bit AdamW, its CPU kernel) against this
    reference on one parameter of 8192 elements (8-bit state, blocks of 256 from its start,
    as ours): six steps, each from the same state on both sides (ours copied into theirs
    before the step), so that each step's differences are that step's own."""
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbf
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        return {"available": False, "why": f"{type(e).__name__}: {e}"}
    out = {"available": True, "version": bnb.__version__}
    for name, signed in (("signed", True), ("unsigned", False)):
        theirs = bnbf.create_dynamic_map(signed=signed).numpy().astype(np.float32)
        ours = (SIGNED if signed else UNSIGNED)[0]
        ulps = np.abs(theirs.view(np.int32).astype(np.int64) - ours.view(np.int32).astype(np.int64))
        out[f"map_{name}"] = {"values_differing": int((ulps != 0).sum()), "max_ulps": int(ulps.max())}
    n = 8192
    master = rng.uniform(-1, 1, n).astype(np.float32)
    p = torch.nn.Parameter(torch.from_numpy(master.copy()))
    opt = bnb.optim.AdamW8bit([p], lr=LRS[0], betas=(BETA1, BETA2), eps=EPS, weight_decay=WD)
    mq, vq = np.full(n, 127, np.uint8), np.zeros(n, np.uint8)
    ma, va = np.zeros(n // BLOCK, np.float32), np.zeros(n // BLOCK, np.float32)
    worst = {"master_max_abs_diff": 0.0, "master_max_abs_step": 0.0, "exp_avg_codes_differing": 0.0,
             "exp_avg_sq_codes_differing": 0.0, "absmax_rel": 0.0, "theirs_nearer": 0}
    blocks = np.arange(n) // BLOCK
    for t in range(STEPS):
        g = (rng.standard_normal(n) * 0.01).astype(np.float32)
        for group in opt.param_groups:
            group["lr"] = LRS[t]
        if t > 0:  # the same state on both sides
            st = opt.state[p]
            st["state1"].copy_(torch.from_numpy(mq))
            st["state2"].copy_(torch.from_numpy(vq))
            st["absmax1"].copy_(torch.from_numpy(ma))
            st["absmax2"].copy_(torch.from_numpy(va))
            p.data.copy_(torch.from_numpy(master))
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        c = coefficients(LRS[t], t + 1, 1.0)
        m, v, step = moments_step(c, q8_decode(mq, ma, SIGNED), q8_decode(vq, va, UNSIGNED), g)
        mq, ma = q8_encode(m, SIGNED)
        vq, va = q8_encode(v, UNSIGNED)
        master = master_step(c, master, step, np.ones(n, dtype=bool))
        st = opt.state[p]
        worst["master_max_abs_diff"] = max(worst["master_max_abs_diff"], float(np.abs(p.detach().numpy() - master).max()))
        worst["master_max_abs_step"] = max(worst["master_max_abs_step"], float(np.abs(step).max()))
        worst["absmax_rel"] = max(worst["absmax_rel"], float(np.abs(st["absmax1"].numpy() - ma).max() / ma.max()),
                                  float(np.abs(st["absmax2"].numpy() - va).max() / va.max()))
        for key, ours, state, value, absmax, qmap in (("exp_avg", mq, "state1", m, ma, SIGNED),
                                                      ("exp_avg_sq", vq, "state2", v, va, UNSIGNED)):
            theirs = st[state].numpy()
            differ = theirs != ours
            worst[f"{key}_codes_differing"] = max(worst[f"{key}_codes_differing"], float(differ.mean()))
            # Where the codes differ, whose decoded value is nearer the float32 moment.
            mine = np.abs(qmap[0][ours] * absmax[blocks] - value)
            other = np.abs(qmap[0][theirs] * absmax[blocks] - value)
            worst["theirs_nearer"] += int((other < mine)[differ].sum())
    out["six_steps_worst"] = worst
    # The master follows the moments before encoding, so each step agrees to float32 noise
    # (their kernel fuses multiply-adds); where a code differs, ours is never the farther
    # (their CPU quantizer approximates the nearest code for the smallest magnitudes).
    assert worst["master_max_abs_diff"] < 1e-6, worst
    assert worst["theirs_nearer"] == 0, worst
    return out


def main():
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "golden" / "optim"
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    start = rng.uniform(-1, 1, N).astype(np.float32)
    grads = []
    for t in range(STEPS):
        g = (rng.standard_normal(N) * 10.0 ** rng.uniform(-4, -1)).astype(np.float32)
        if t == 0:
            g[BLOCK:2 * BLOCK] = 0  # a block with no gradient: absmax 0 on the first step
        grads.append(g)
    tensors = {"start": start}
    for t, g in enumerate(grads):
        tensors[f"grad.{t}"] = g
    modes = [(m, w) for w in ("f32", "bf16_kahan") for m in ("f32", "bf16", "q8")]
    for moments, master in modes:
        for t, state in enumerate(run_mode(moments, master, start, grads)):
            for key, value in state.items():
                tensors[f"{moments}.{master}.{t}.{key}"] = value
    save_file(tensors, str(out_dir / "adamw_modes.safetensors"))
    meta = {"n": N, "block": BLOCK, "steps": STEPS, "beta1": BETA1, "beta2": BETA2, "eps": EPS,
            "weight_decay": WD, "lr": LRS, "grad_scale": GRAD_SCALES,
            "runs": [{"end": e, "decay": d} for e, d in RUNS], "modes": [f"{m}.{w}" for m, w in modes],
            "numpy": np.__version__, "bitsandbytes": compare_with_bitsandbytes(rng)}
    (out_dir / "adamw_modes.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta["bitsandbytes"], indent=1))


if __name__ == "__main__":
    main()
