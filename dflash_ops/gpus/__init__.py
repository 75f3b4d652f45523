"""GPUs and what holds them, read on the machine that owns them: the facts, holders and kill plan (`facts`) and the
bash that probes and kills (`scripts`), both pure; the `gpu-reset` use case that runs them through a Transport
(`reset`)."""
