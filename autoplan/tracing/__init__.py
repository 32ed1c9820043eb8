"""Stage 2, the trace: the model's operator graph with each op's FLOPs, bytes moved and bytes saved
for backward (`fx_tracer`, or `dispatch_tracer` where torch.fx cannot read the model; `tracer`
chooses), counted by `counting`; a stack of alike blocks traced by a few of them (`reuse`, `expand`),
with a progress bar where every block must be traced (`progress`); and the FSDP units the graph is cut
into (`units`)."""
