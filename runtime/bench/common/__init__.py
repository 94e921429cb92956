"""What several benches share: the bus pipeline, timing and cold reads, peak memory, a trained run's
weights, the numerics benches' sampling and scoring. Nothing here is a bench of its own."""
