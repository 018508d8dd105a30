"""The user-program runtime of a trainer: schedules, async transfers, checkpoints, the stage loop."""
