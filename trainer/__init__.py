"""trainer: the DFlash block-diffusion drafter trainer.

Layout (functional core, imperative shell; docs/architecture.md draws it):
  __main__.py          the CLI (train, eval, export, make-tiny-target) and its one error boundary (errors.py)
  config/              one typed config tree: schema.py (the dataclasses), loader.py (recipes/*.yaml + --set, one
                       parser), recipes.py (bundled names, recipe kinds); validated once
  placement.py         device specs -> devices (the one resolver); distributed.py: torchrun process group, grad sync
  build.py             config -> Session: target, data, drafter + optimizer, runner or pipeline (captured here)
  loop.py              TrainLoop: drives a Session until a StopRule (steps, time budget); metrics.py: the only syncs
  train.py             the program: build -> loop -> final checkpoint, export, eval; `trainer export`
  rundir.py            what a run leaves on disk; checkpoint.py (ckpt/step_N), export.py (the serving export)
  eval.py              simulated acceptance length tau on held-out rows; prompts.py: prompt files (GSM8K, MATH-500,
                       HumanEval, MBPP, MT-Bench, chat, ShareGPT, plain) for real decoding (`trainer eval --prompts`)
  tracking.py          TensorBoard / W&B / MLflow beside metrics.jsonl (track.backends)
  capture.py           CUDA graph capture, the one way (training, pipeline, decoding)
  data/                source (JSONL -> samples), packing, anchors (pure), batching (StaticBatch, EpochBatches)
  model/               target (frozen HF, taps), drafter, block attention (+ flex), doc-causal target attention, loss
  step/                step.py (forward/backward, optimizer step), slots.py (the flat step encoding), policy.py
                       (compile, FP8 head, CE kernel), stepper.py (the eager or captured Stepper, one builder; the
                       sequential Runner), graph.py (StepGraph: the captured step)
  pipeline/            loader / target producer / drafter consumer threads over an event ring
  decode/              batch-1 decoding: static-cache graph engine, its Triton kernels, the HF-cache reference
  quality/             the quality pipeline (pretrain -> regenerate -> drafter -> eval) and its sweep
  tiny.py, smoke_data.py  the tiny target and the bundled smoke dataset
Benchmarks live outside the package, in the repository's bench/.
"""
