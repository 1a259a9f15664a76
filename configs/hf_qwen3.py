"""An unmodified Hugging Face Qwen3 causal LM (randomly initialized at these sizes, no download)
on the built-in corpus: 2 data ranks x 2-way tensor parallel (shardlib.models.hf_preset, proven
exact when sharded), ZeRO-1. model.pretrained='path/to/saved_model' trains a saved model instead
(its own sizes; set data.tokenizer to its tokenizer.json)."""

parallel = dict(mesh={"dp": 2, "tp": 2}, zero_stage=1)
model = dict(builder="hf", family="qwen3", hidden=128, layers=4, heads=4, block_size=128)
optim = dict(lr=2e-3, warmup_steps=20, decay="cosine", grad_clip=1.0)
data = dict(source="embedded", tokenizer="bytes")
train = dict(steps=200, global_batch=16, seq_len=128, log_interval=20, eval_interval=100)
