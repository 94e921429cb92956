"""Shared by several tests (was test_train_step.py's)."""

from __future__ import annotations
import numpy as np
import torch
from reel.bus.events import Sample, Tensor, Trajectory
from reel.runtime.train.batch import Group
from reel.runtime.config.sections import Config
from reel.runtime.config.run import from_dict
from reel.runtime.model.config import MoEConfig
from reel.runtime.model.model import MoEModel
from reel.runtime.train.step import TrainState, make_optimizer


MODEL = MoEConfig(vocab_size=24, hidden_size=32, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2)

def step_config(**trainer: object) -> Config:
    return from_dict({"trainer": {"batch_groups": 2, **trainer}, "rollout": {"concurrency": 2}})

def random_groups(model: MoEModel, seed: int, n_groups: int = 2, samples: int = 4) -> list[Group]:
    """Groups sampled from `model` itself (so logprobs and routing are real), rewards made up."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(n_groups):
        prompt = torch.randint(3, MODEL.vocab_size, (int(torch.randint(2, 5, (1,), generator=gen)),), generator=gen)
        out_samples, routing = [], []
        for s in range(samples):
            completion = torch.randint(3, MODEL.vocab_size, (int(torch.randint(2, 6, (1,), generator=gen)),),
                                       generator=gen)
            ids = torch.cat([prompt, completion[:-1]])[None]
            with torch.no_grad():
                out = model(ids, return_routing=True)
            logp = torch.log_softmax(out.logits[0], -1)[len(prompt) - 1:].gather(-1, completion[:, None])[:, 0]
            # Perturb mu a little: inference never matches the trainer exactly.
            logp = logp + 0.01 * torch.randn(logp.shape, generator=gen)
            out_samples.append(Sample(tokens=Tensor.from_torch(completion.int()), logprobs=Tensor.from_torch(logp),
                                      reward=float(torch.rand((), generator=gen)), finish_reason="stop", seed=s,
                                      spans=[(0, 0)]))
            routing.append(out.routing[0].numpy().astype(np.uint8))
        traj = Trajectory(run="t", producer="rollout:0", seq=g, group_id=f"g{seed}-{g}", env="test",
                          prompt=Tensor.from_torch(prompt.int()), samples=out_samples, worker="0")
        groups.append(Group(traj, routing))
    return groups

def fresh_state(config: Config, seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = MoEModel(MODEL)
    return TrainState(model, make_optimizer(model, config.trainer), 0)
