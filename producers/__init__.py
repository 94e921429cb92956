"""The rollout side: prompts in, trajectory and routing events out (engines, envs, the rollout worker).

Imports bus/ and runtime's core; never consumers/.
"""
