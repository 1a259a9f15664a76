"""The embedded default: a 0.8M-parameter byte-level GPT on the built-in corpus (the Python
standard library's source), ZeRO-3 over every rank; about 20 seconds on 2 CPU ranks. Any key left out takes its default
(shardlib.config.SCHEMA); override one with --set section.key=value."""

parallel = dict(mesh={"dp": -1}, zero_stage=3)  # -1: every rank
model = dict(builder="gpt", n_layer=4, n_head=4, n_embd=128, block_size=64)
optim = dict(lr=1e-3, warmup_steps=10, decay="cosine", grad_clip=1.0)
data = dict(source="embedded", tokenizer="bytes")
train = dict(steps=200, global_batch=16, seq_len=64, log_interval=20, eval_interval=100)
checkpoint = dict(dir=None)
