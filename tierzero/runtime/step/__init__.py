"""What one wrapped model's blocks share in a step: the step's context (its phase and thread,
the all-gathers started ahead, the optimizer's callbacks), the one device account, the schedule
the blocks' hooks consult (plain or layer-major) and the overlapped step's queue. The modules,
in import order: docs/architecture.md ("The runtime's modules")."""
