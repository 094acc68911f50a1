"""Shared types below every other package: a request (`Req`), the scheduler's batch
(`ScheduleBatch`), one forward's inputs (`ForwardMode`, `ForwardBatch`) and its prepared step
and output (`PreparedStep`, `StepOutput`), a speculative algorithm's KV footprint
(`SpecFootprint`) and the holey draft layout (`HoleyLayout`). They import nothing of
plugserve's but the physical pools (`plugserve.pools`) and the request's sampling parameters,
so the scheduler, the KV manager, the runner and the attention backends all share them
without importing each other."""
