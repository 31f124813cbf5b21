"""What happens when something goes wrong or runs out: faults, cut streams, keepalive, disconnects, back-pressure,
fuzzing, replicas, limits."""
