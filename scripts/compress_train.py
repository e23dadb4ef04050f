"""A small real training run for compressed checkpoints: the tiny PaddleFormers Llama the tests
use (built from a config: no download), trained on this repository's documentation as text
(one byte a token), with paddle's AdamW, saved at a step through paddle_dcp and resumed from the
checkpoint. The suite compress of the benchmarks (scripts/bench/compress.py) measures with it;
tests/integration/test_resume_compressed.py asserts with it that a resume from a compressed checkpoint follows the uncompressed resume.

Mixed precision, emulated: paddle 3.3.1's CPU build has neither a bfloat16 matmul nor a
bfloat16 AdamW kernel (both raise NotFound), so ``AdamW(multi_precision=True)`` cannot run on
bfloat16 parameters here. The run does what O2 mixed precision does to the weights: the
optimizer's float32 parameters are the master weights; every step evaluates the model (forward
and backward, in float32 arithmetic) at the master weights rounded to bfloat16, then AdamW
updates the float32 masters with those gradients. The checkpoint is laid out as paddle's O2
job's: ``{"model": {key: bfloat16 parameter (paddle's name kept)}, "opt": {moments and beta
powers by paddle's names, "master_weights": {param.name: float32 master}}}``. So a resume from
derived master weights starts from exactly what it would on a GPU: each master weight replaced
by its bfloat16 parameter. (Activations stay float32: the emulation is of the weights only.)
"""
from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass, field

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SEQ, BATCH = 64, 8


def text_tokens() -> np.ndarray:
    """This repository's documentation (README.md, docs/*.md, sorted) as bytes below 128."""
    paths = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
    data = b"".join(open(p, "rb").read() for p in paths)
    tokens = np.frombuffer(data, np.uint8).astype(np.int64)
    tokens[tokens >= 128] = 0
    return tokens


def tiny_llama(hidden: int = 64, layers: int = 2, seed: int = 0):
    """The tiny Llama of tests/multirank/scripts/pformers.py (vocabulary 128, float32), on one
    process; ``hidden`` and ``layers`` scale it."""
    if "pyarrow" not in sys.modules:  # `datasets` may want a newer numpy than the one installed; unused
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            sys.modules["datasets"] = None  # type: ignore[assignment]
    import paddle
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, tensor_model_parallel_size=1,
        fuse_rms_norm=False, dtype="float32",
    )
    paddle.seed(seed)
    return LlamaForCausalLM(config)


@dataclass
class Run:
    """A model, its AdamW and the text, and the losses of the steps run so far (by step)."""

    model: object
    opt: object
    tokens: np.ndarray
    seed: int = 0
    losses: dict = field(default_factory=dict)

    @classmethod
    def start(cls, hidden: int = 64, layers: int = 2, lr: float = 3e-3, seed: int = 0) -> "Run":
        import paddle

        model = tiny_llama(hidden, layers, seed)
        opt = paddle.optimizer.AdamW(learning_rate=lr, parameters=model.parameters(), weight_decay=0.01)
        return cls(model, opt, text_tokens(), seed)

    @property
    def params(self) -> list:
        return list(self.model.parameters())

    def batch(self, step: int):
        """Step ``step``'s batch: the same for every run of this seed."""
        import paddle

        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - SEQ - 1, BATCH)
        x = np.stack([self.tokens[s : s + SEQ + 1] for s in starts])
        return paddle.to_tensor(x[:, :-1]), paddle.to_tensor(x[:, 1:])

    def step(self, step: int) -> float:
        """One training step at the master weights rounded to bfloat16 (see the module doc)."""
        import paddle

        masters = [paddle.assign(p) for p in self.params]
        with paddle.no_grad():
            for p in self.params:
                p.set_value(p.astype("bfloat16").astype("float32"))
        ids, labels = self.batch(step)
        out = self.model(input_ids=ids, labels=labels)
        loss = out[0] if isinstance(out, (tuple, list)) else out.loss
        loss.backward()
        with paddle.no_grad():
            for p, m in zip(self.params, masters):
                p.set_value(m)
        self.opt.step()
        self.opt.clear_grad()
        self.losses[step] = float(loss)
        return self.losses[step]

    def train(self, first: int, last: int) -> list:
        """Steps ``first`` .. ``last`` (inclusive, numbered from 1): their losses."""
        return [self.step(s) for s in range(first, last + 1)]

    def checkpoint(self) -> dict:
        """The state as paddle's O2 job would save it: bfloat16 parameters under the model's
        keys (paddle's names kept), AdamW's state by paddle's names, the float32 master
        weights under ``master_weights`` by the parameters' names."""
        model = {}
        for key, p in self.model.named_parameters():
            half = p.astype("bfloat16")
            half.name = p.name
            model[key] = half
        opt = dict(self.opt.state_dict())
        opt["master_weights"] = {p.name: p for p in self.params}
        return {"model": model, "opt": opt}

    def target(self) -> dict:
        """Where a load puts the checkpoint back: the live optimizer state and master weights
        (filled in place); the bfloat16 parameters into scratch tensors (each step makes them
        anew from the masters)."""
        import paddle

        state = self.checkpoint()
        state["model"] = {k: paddle.zeros(v.shape, "bfloat16") for k, v in state["model"].items()}
        return state

    def moments(self) -> dict:
        """AdamW's moments, flat key -> a numpy copy."""
        return {f"opt.{k}": v.numpy().copy() for k, v in self.opt.state_dict().items() if "moment" in k}

    def masters(self) -> dict:
        return {f"opt.master_weights.{p.name}": p.numpy().copy() for p in self.params}


def resume(run: Run, path: str, first: int, last: int) -> list:
    """Load checkpoint ``path`` into ``run`` (every optimizer state and master weight) and train
    steps ``first`` .. ``last``: their losses."""
    import paddle_dcp

    paddle_dcp.load_state_dict(run.target(), path)
    return run.train(first, last)
