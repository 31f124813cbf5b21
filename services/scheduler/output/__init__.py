"""What the scheduler publishes: a step's StepMessage, and the journal that replays it to new subscribers."""
