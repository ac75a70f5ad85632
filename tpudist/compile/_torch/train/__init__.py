"""Training: `compile_train_step` (one executable per step: forward, backward, optimizer) and `fit`.

`_fused.TrainStep` owns the step's lifecycle: per batch signature a `_signature.Signature` captures
(`_plan`, `_body`) and runs the executable, and `TrainStep` applies the `StepOutputs` it returns;
`_state.Mirror` keeps parameters and optimizer state on the devices (`_device.DeviceState`) and brings
torch up to date only through its doors (state_dict, an eager call, `sync()`, and any read of a tensor
a step left stale: `_stale`); `_groups` watches the
optimizer's param groups, `_optim` is the optimizer update in JAX; `_fit` the loops (`fit`, `eager_step`, `optimizer_step`) with
their I/O (`_fit_io`) and exact resume (`_resume`); `_loader` feeds batches to the devices;
`_memory` reports the bytes the step holds per device (`step.memory()`).
"""
