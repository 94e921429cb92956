"""vf-reverse: a verifiers 0.4 (`verifiers.v1`) environment, written the way prime-rl users write theirs.

The prompt asks to reverse a random lower-case string ("reverse:abcde="). Two `@vf.reward` functions
score the answer: `exact` (weight 0.7) and `overlap`, the share of positions already right (weight
0.3), so a near miss still earns something. `split = "eval"` gives words disjoint from the train
split's (Reel's eval role reads it).

Its harness (`ChatHarness`, exported beside the taskset so it is the taskset's default) runs the
chat loop in process: no program is installed or launched, so it works offline. With `tools = true`
the model may call `peek(i)`, which answers the word's i-th letter, before it answers: a multi-turn
episode with tool calls.
"""

from vf_reverse.harness import ChatHarness
from vf_reverse.taskset import ReverseTaskset

__all__ = ["ReverseTaskset", "ChatHarness"]
