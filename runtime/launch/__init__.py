"""How a run starts: the `reel` command line and the processes it starts.

    cli.py          `reel`: parse arguments, hand over to the module that does the work
    supervisor.py   `reel run` / `reel role`: the run directory, one process per role, all stop when one fails
    progress.py     the supervisor's progress view
    bus_access.py   how the processes reach an external Redis (ACL user, password, TLS files)
    role_users.py   one Redis user per role, allowed to XADD only to its role's streams
    slurm.py        `reel launch slurm|status|cancel`: a whole run as one Slurm heterogeneous job
    vllm_args.py    `vllm serve` command lines for a run
    vllm_serve.py   a local `vllm serve` for one model directory (benches, tests)

    bus_loss.py     on resume: did Redis lose writes the log had already archived

This is the shell: it sits above producers/ and consumers/ and starts them. What a training step
computes lives beside it in runtime/train/, the run schema both sides read in runtime/config/.
"""
