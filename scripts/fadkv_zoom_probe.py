"""fadkv with a zoom: what exact detail for the few chunks a query attends to most adds to fadkv's codes.

A research probe for zoomr's layout (docs/decisions.md): zoomr keeps dense summary tokens as its index and the rest
of every finished thought off the device, and at a device budget of 0.25 of a 2,048-token output even an oracle's
choice of thoughts stayed under window. This probe asks the other layout: every old token coded as fadkv codes it
(the index is the codes themselves, 19 to 40 times smaller than a dense token), and at each decode step the `--zoom`
chunks of `--chunk` positions that this step's coded attention weighs most (summed over the layer's query heads, one
choice a layer and row) read their exact keys and values instead of their codes. The exact keys and values are kept
beside the cache for the probe (off the device in a real layout); the bench's measured ratio counts fadkv's bytes
alone, so the zoomed tokens' device bytes, `zoom x chunk` dense tokens, are added by hand in the decisions page.

Runs the kvzip command (`bench` and its arguments pass through) with every fadkv layer's decode attention replaced
(the PyTorch reference path; the prompt's forward and the coding are fadkv's own). `--zoom 100000` zooms in on every
chunk: its cells must score as `full` does (the check that the probe reads the right exact tokens). `--lag` zooms in
on the chunks the previous step chose, each layer its own (what a GPU can fetch from the host while a step runs).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/fadkv_zoom_probe.py --zoom 4 --chunk 32 bench --budgets 0.25 \\
        --workloads output --output-tokens 2048 --rows 4 --methods full \\
        --method-set fadkv:kernel=torch --dtype bfloat16 --json /tmp/z.json
"""

from __future__ import annotations

import sys

import torch

from kvzip.methods.coded import layer as coded_layer
from kvzip.methods.coded.attend import LayerInputs, allowed_tokens, coded_attention, prerope_scores
from kvzip.sparse import coded_attention as coded

ZOOM, CHUNK, LAG = 4, 32, False
fadkv_update = coded_layer.FadkvLayer.update


def update(self, key_states, value_states, *args, **kwargs):
    """fadkv's update, and every token's exact key and value (after RoPE, as attention reads them) kept aside in a
    store that doubles when full, column j holding position j."""
    n = key_states.shape[2]
    if not self.is_initialized or getattr(self, "exact", None) is None:
        self.exact, self.exact_len = None, 0
    if self.exact is None or self.exact_len + n > self.exact[0].shape[2]:
        width = max(2 * (self.exact_len + n), 1024)
        grown = tuple(x.new_zeros(*x.shape[:2], width, x.shape[3]) for x in (key_states, value_states))
        if self.exact is not None:
            for new, old in zip(grown, self.exact):
                new[:, :, : self.exact_len] = old[:, :, : self.exact_len]
        self.exact = grown
    for store, x in zip(self.exact, (key_states, value_states)):
        store[:, :, self.exact_len : self.exact_len + n] = x
    self.exact_len += n
    return fadkv_update(self, key_states, value_states, *args, **kwargs)


def attend(self, module, query, key, value, mask, scaling, state=None):
    inputs = LayerInputs() if state is None else state.of(self.idx)
    tiers = self.tiers()
    if query.shape[2] != 1 or tiers.coded_pos.shape[1] == 0:  # a prompt, or nothing coded yet: fadkv's own
        return coded_attention(query, mask, scaling, tiers, self.key_mean, self.rope, inputs)
    return zoomed(self, query, mask, scaling, tiers, inputs)


def zoomed(layer, query, mask, scaling, tiers, inputs) -> torch.Tensor:
    """One decode query (B, Hq, 1, d) -> (B, 1, Hq, d): fadkv's reference attention, then the ZOOM chunks with the
    most coded-attention mass attended on their exact keys and values (their coded columns masked, their exact ones
    added)."""
    b, hq, _, d = query.shape
    t, h = tiers.coded_pos.shape[1], tiers.keys.shape[1]
    g = hq // h
    qg = query.float().reshape(b, h, g, d) * scaling
    dense_scores = qg @ tiers.keys.float().transpose(-1, -2)  # (B, H, g, S)
    keys = tiers.coded_keys
    if layer.rope is not None:
        if inputs.turns is None:
            raise SystemExit("fadkv_zoom_probe.py: run fadkv on the PyTorch path (--method-set fadkv:kernel=torch)")
        c_scores = prerope_scores(qg, keys, layer.key_mean, layer.rope, inputs.turns)
    else:
        c_scores = coded.coded_scores(keys.atom_scores(qg), keys.numbers(), keys.codes.coefficients())
        if layer.key_mean is not None:
            c_scores = c_scores + qg @ layer.key_mean[None, :, :, None].float()
    positions = torch.cat([tiers.coded_pos, tiers.positions], 1)
    allowed = allowed_tokens(mask, positions, 1, positions.shape[1], query.device)[:, None]  # (B, 1, 1, W)

    w = torch.softmax(torch.cat([c_scores, dense_scores], -1).masked_fill(~allowed, float("-inf")), -1)
    pos = tiers.coded_pos  # (B, T), -1 a hole
    chunk = pos.clamp(min=0) // CHUNK
    mass = w[..., :t].nan_to_num(0.0).sum((1, 2)) * (pos >= 0)  # (B, T): over the layer's query heads
    per = mass.new_zeros(b, int(chunk.max()) + 1).scatter_add_(1, chunk, mass)
    top = per.topk(min(ZOOM, per.shape[1]), dim=1).indices  # (B, k) chunks
    if LAG:  # the chunks the previous step chose (a GPU fetches them while this step runs); this step's for the next
        top, layer.zoom_next = getattr(layer, "zoom_next", None), top
        if top is None or top.shape[0] != b:
            top = per.new_zeros(b, 0, dtype=torch.long)
    # every position of the chosen chunks that is coded: its coded column is masked, its exact key joins as a column
    column = pos.new_full((b, int(pos.max()) + CHUNK + 1), -1)
    column.scatter_(1, pos.clamp(min=0), torch.where(pos >= 0, torch.arange(t, device=pos.device), -1))
    zpos = (top[:, :, None] * CHUNK + torch.arange(CHUNK, device=pos.device)).flatten(1)  # (B, Z)
    zcol = column.gather(1, zpos)
    seen = allowed[:, 0, 0, :t]  # (B, T): coded columns this query may see
    zvalid = (zcol >= 0) & seen.gather(1, zcol.clamp(min=0))
    hidden = torch.zeros(b, t, dtype=torch.bool, device=pos.device)
    rows = torch.arange(b, device=pos.device)[:, None].expand_as(zcol)
    hidden[rows[zvalid], zcol[zvalid]] = True
    at = zpos.clamp(max=layer.exact[0].shape[2] - 1)[:, None, :, None].expand(b, h, zpos.shape[1], d)
    exact_k, exact_v = (x.float().gather(2, at) for x in layer.exact)  # (B, H, Z, d)
    z_scores = (qg @ exact_k.transpose(-1, -2)).masked_fill(~zvalid[:, None, None], float("-inf"))
    c_scores = c_scores.masked_fill((hidden | ~seen)[:, None, None], float("-inf"))
    scores = torch.cat([c_scores, z_scores, dense_scores.masked_fill(~allowed[..., t:], float("-inf"))], -1)
    w = torch.softmax(scores, -1).nan_to_num(0.0)
    z = zpos.shape[1]
    out = w[..., t + z :] @ tiers.values.float() + w[..., t : t + z] @ exact_v
    w_coded = w[..., :t]
    values = tiers.coded_values
    v_idx, v_st, v_sc = values.numbers(), values.codes.stored, values.codes.scale
    w_coded = w_coded if v_sc is None else w_coded * v_sc.float().transpose(-1, -2)
    w_atoms = coded.atom_weights(w_coded, v_idx.long(), coded.dequantize(v_st, None), values.n_total() + 1)
    out = out + values.values_from_atoms(w_atoms)
    return out.view(b, hq, 1, d).transpose(1, 2).to(query.dtype).contiguous()


if __name__ == "__main__":
    while sys.argv[1:2] and sys.argv[1] in ("--zoom", "--chunk", "--lag"):
        if sys.argv[1] == "--lag":
            LAG = True
            del sys.argv[1]
            continue
        if sys.argv[1] == "--zoom":
            ZOOM = int(sys.argv[2])
        else:
            CHUNK = int(sys.argv[2])
        del sys.argv[1:3]
    coded_layer.FadkvLayer.update = update
    coded_layer.FadkvLayer.attend = attend
    from kvzip.cli import main

    main()
