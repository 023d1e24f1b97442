#!/usr/bin/env python3
"""Does a resident HF+bnb+PEFT forward give the same loss with and without grad? (CUDA diagnosis)

    python -m tools.sdpa_grad_mode_check

Poros runs each block's forward without grad (it recomputes with grad in backward); if the
attention backend that PyTorch picks depends on grad mode, the streamed forward can differ from
the resident one. For each family/attention/determinism setting: loss with grad vs without grad on
a right-padded batch of 2, and whether poros (micro-major) matches the with-grad loss.
"""
import itertools, json, pathlib, tempfile
import torch
import poros
from poros.testing import load_qlora, save_tiny_checkpoint

work = pathlib.Path(tempfile.mkdtemp())
rows = []
for family, head_dim, attn, det in itertools.product(["qwen2", "qwen3"], [16, 32], ["sdpa", "eager"], [True, False]):
    torch.use_deterministic_algorithms(det)
    extra = {} if family == "qwen2" else {"head_dim": head_dim}
    hidden = 4 * head_dim if family == "qwen2" else 64
    path = save_tiny_checkpoint(work / f"{family}-{head_dim}", family, hidden_size=hidden, num_heads=4,
                                vocab_size=2048, **extra)
    ids = torch.randint(3, 2048, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids); mask[1, 40:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    model = load_qlora(path, attn_implementation=attn).cuda()
    with_grad = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.detach()
    with torch.no_grad():
        without = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    streamed = poros.prepare(model)
    poros_loss = streamed(input_ids=ids, attention_mask=mask, labels=labels).loss.detach()
    rows.append(dict(family=family, head_dim=head_dim, attn=attn, deterministic=det,
                     grad_vs_nograd_equal=bool(torch.equal(with_grad, without)),
                     poros_equal=bool(torch.equal(with_grad, poros_loss)),
                     diff=float((with_grad - without).abs())))
    print(json.dumps(rows[-1]), flush=True)
