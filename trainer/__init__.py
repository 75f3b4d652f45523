"""trainer: the DFlash block-diffusion drafter trainer.

Layout (functional core, imperative shell):
  config.py            typed config tree (recipes/*.yaml + --set), validated once
  data/                source (JSONL -> samples), packing, anchors (pure), batching (StaticBatch, EpochBatches)
  model/target.py      frozen HF target: tapped-layer hooks, truncation, packed block-diagonal causal mask
  model/drafter.py     the drafter (pure torch, z-lab DFlashDraftModel parameter names)
  model/attention.py   block visibility rule + block_attention(q, k, v, layout, backend)  [flex.py: GPU branch]
  model/loss.py        same-position labels, decay weights, chunked LM-head CE
  step/step.py         forward_backward / optimizer_step / EagerRunner              [graph.py: GPU branch]
  train.py             setup + loop; metrics.py (the only host syncs); checkpoint.py; export.py; eval.py
  tiny.py, smoke_data.py  the tiny target and the bundled smoke dataset
"""
