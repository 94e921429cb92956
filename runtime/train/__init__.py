"""One training step and what feeds it; called alike by the trainer, `reel replay` and `reel retrain`.

    step.py           train_step(state, batch, config) -> StepResult: pure, bitwise reproducible
    batch.py          logged groups -> the tensors of one step;  groups.py: groups by id from the log
    group_checks.py   is a group trainable at all;  finite.py: a non-finite step never becomes a version
    loss.py           RL objectives and mismatch metrics;  mismatch_split.py: numerics vs policy drift
    distributed.py    N ranks, one logical trainer (FSDP2);  trainer_group.py: rank 0 drives, others follow
    torchrun.py       how N ranks start (torchrun's command line; no torch import, for the launcher)
    reexecute.py      rebuild the state after any committed step from a checkpoint
    initial_policy.py version 0 of the policy;  environment.py: what a step depends on beyond config

Imports bus/, model/, weights/, checkpoint/ and config/; never producers/, consumers/ or launch/.
"""
