"""From a command's settings to one PlanRequest: the model resolved and traced, the cluster and the meshes
to search on it, the limits, the micro-batches, the pins.

`search`, `estimate`, `frontier`, `explain` and `diff` all start here, so they resolve a model, default a
setting and refuse bad input the same way, in the same order: what can be checked without tracing (the
sequence length, the cluster, the tensor-parallel degree, the memory limit, the batch) is checked before
the model is traced. An estimate of a plan file (or an explanation of one) takes every setting the user
left out from the plan, and its model from the plan's data only (never code the plan names).
"""

from __future__ import annotations

import sys
from pathlib import Path

from autoplan.api.traced import TracedModel, reuse_traced
from autoplan.errors import PlanFileError, UsageError
from autoplan.models.experts import ExpertInfo, check_expert_degree, experts_of
from autoplan.models.fingerprint import model_fingerprint
from autoplan.models.resolve import check_seq_len, model_from_plan
from autoplan.models.zoo import count_params
from autoplan.plan.schema import Plan, load_plan
from autoplan.settings import EstimateSettings, PlanningSettings, SearchSettings, check_mem_limit
from autoplan.solve.cluster import Cluster, resolve_cluster
from autoplan.solve.context_tables import MIN_CONTEXT_SEQ
from autoplan.solve.pins import PinResolution, resolve_pins
from autoplan.solve.request import Batch, Limits, ModelInfo, PlanRequest, Uniform
from autoplan.solve.tables import CostTables
from autoplan.tracing.units import wrap_paths
from cost_models.allocator_conf import DEFAULT_ALLOC_CONF, environment_conf, modelled_options
from cost_models.evaluate import checkpoint_name
from cost_models.mesh import Mesh, MeshError
from cost_models.options import DEFAULT_SHARDING, SHARDING_KINDS
from cost_models.training import Training

__all__ = ["allocator_conf", "load_plan_of", "pipeline_meshes_of", "prepare", "search_meshes_of", "wrap_policy_of"]


def prepare(settings: PlanningSettings, plan: Plan | None = None, plan_file: Path | None = None) -> PlanRequest:
    """The request of a search (SearchSettings) or of an estimate (EstimateSettings: of a uniform strategy, or
    of its `plan`, whose settings fill those not given; `plan` and `plan_file` where the caller loaded it
    already). UsageError (or PlanFileError) for bad input, raised before the model is traced where it can be."""
    if plan is None:
        plan, plan_file = load_plan_of(getattr(settings, "plan", None))
    mem_source = "the plan's memory limit" if plan is not None and settings.mem is None else "`mem`"
    if plan is not None:
        settings = _with_plan_defaults(settings, plan, plan_file)
    session = reuse_traced(settings.model_or_default, settings.seq_len, settings.example_inputs)
    check_seq_len(session.resolved, session.seq_len)
    if plan is not None and model_fingerprint(session.module) != plan.model.fingerprint:
        raise PlanFileError(f"the plan{f' {plan_file}' if plan_file else ''} was made for a different model than "
                            f"{session.name} (module tree or parameter shapes differ); search again for this model")
    cluster = resolve_cluster(settings.gpus, settings.nodes, settings.gpus_per_node, settings.profile,
                              settings.host_mem)
    session.price_for(settings, cluster.profile.device_type, plan)  # attention kernels, capacity factor, unpriced ops
    experts = experts_of(session.module)
    meshes = (search_meshes_of(settings, cluster.mesh, experts, session.name, session.seq_len) if plan is None
              else (_plan_mesh(plan, cluster.mesh),))
    pipeline_meshes = pipeline_meshes_of(settings, cluster.mesh) if plan is None else ()
    uniform = _uniform(settings, cluster)
    wrap_policy_of(settings)  # refused before tracing
    mem = settings.mem if settings.mem is not None else cluster.profile.mem_bytes
    check_mem_limit(mem, cluster.profile.mem_bytes, cluster.profile_name, settings.allow_over_device_mem, mem_source)
    searching = isinstance(settings, SearchSettings)
    conf = allocator_conf(settings, cluster)
    fit_to = settings.fit_to if searching else plan.cluster.mem_fitted_to if plan is not None else "needed"
    limits = (Limits(mem, settings.headroom, settings.time_limit_s, conf, fit_to) if searching
              else Limits(mem, allocator_conf=conf, fit_to=fit_to))  # a plan judged by what it was fitted to
    batch = Batch(settings.batch_size if searching else settings.batch_size or 1, settings.global_batch)
    batch.candidates(meshes[0].dp)  # a batch that does not divide over the ranks, refused before tracing
    for mesh in {m.pp: m for m in meshes + pipeline_meshes if m.pp > 1}.values():
        batch.candidates(mesh.dp)
    training = Training(session.seq_len, settings.dtype_or_default, settings.optimizer_or_default)
    tables, pins = _tables(session, training, settings, plan)
    model = ModelInfo(name=session.name, config=session.resolved.config, n_params=count_params(session.module),
                      fingerprint=model_fingerprint(session.module), module=session.module,
                      notes=session.notes(training.compute_dtype))
    return PlanRequest(model=model, tables=tables, training=training, granularity=settings.granularity_or_default,
                       cluster=cluster, meshes=meshes, batch=batch, limits=limits, pins=pins, uniform=uniform,
                       pipeline_meshes=pipeline_meshes, schedule=settings.schedule)


def allocator_conf(settings: PlanningSettings, cluster: Cluster) -> str | None:
    """The PYTORCH_CUDA_ALLOC_CONF a CUDA run of the plan uses: as given, else the environment's
    (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF), else expandable segments (what `autoplan apply` sets); None
    where the profile's device has no CUDA caching allocator."""
    if cluster.profile.device_type != "cuda":
        return None
    if settings.allocator_conf:  # validated with the settings
        return settings.allocator_conf
    try:
        given = environment_conf()
    except ValueError as exc:
        raise UsageError(f"{exc} (or give --allocator-conf)") from None
    if given is None:
        return DEFAULT_ALLOC_CONF
    name, conf = given
    try:
        modelled_options(conf)
    except ValueError as exc:
        raise UsageError(f"{name}={conf!r} in the environment: {exc}") from None
    return conf


def load_plan_of(plan: Plan | str | Path | None) -> tuple[Plan | None, Path | None]:
    """A plan given as a Plan or a file, and the file it came from (its folder holds a relative "hf:" config)."""
    if plan is None or isinstance(plan, Plan):
        return plan, None
    return load_plan(plan), Path(plan)


def search_meshes_of(settings: PlanningSettings, mesh: Mesh, experts: ExpertInfo | None = None,
                     model_name: str = "the model", seq_len: int | None = None) -> tuple[Mesh, ...]:
    """The meshes a search tries on the cluster's `mesh`: each tensor-parallel degree (`tp` itself when given,
    else every degree a node takes), above 1 with and without sequence parallelism (or as
    `sequence_parallel` says); for a model with `experts` that `apply` can split, each with every
    expert-parallel degree that divides the expert count and the data-parallel ranks (`ep` itself when given;
    refused for a model without them); each mesh without experts split with every context-parallel degree
    beside it (`cp` itself when given, else every degree from sequences of MIN_CONTEXT_SEQ tokens up: `seq_len`);
    with a pipeline degree `pp` above 1, each tensor degree's mesh with it (neither expert nor context
    parallelism beside a pipeline yet). An estimate runs on one mesh: the cluster's, at its `tp` (sequence
    parallelism only where asked for), `ep`, `cp` and `pp`."""
    experts = experts or ExpertInfo()
    check_expert_degree(experts, settings.ep or 1, model_name)
    pp = settings.pp or 1
    if pp > 1 and ((settings.ep or 1) > 1 or (settings.cp or 1) > 1):
        raise UsageError("`pp` is not combined with `ep` or `cp` yet: give one of them")
    if not isinstance(settings, SearchSettings):
        tensor = _tensor(mesh, settings.tp or 1, settings.sequence_parallel == "on")
        if pp > 1:
            return (_with_pipeline(tensor, pp),)
        try:
            return (tensor.with_experts(settings.ep or 1).with_context(settings.cp or 1),)
        except MeshError as exc:
            raise UsageError(str(exc)) from None
    if pp > 1:
        variants = _tensor_variants(settings, mesh)
        pipelined = tuple(m for m in (_pipelined(v, pp) for v in variants) if m is not None)
        return pipelined or (_with_pipeline(variants[0], pp),)  # none cut: the first's refusal (UsageError)
    return _with_context(_tensor_meshes(settings, mesh, experts), settings.cp, seq_len)


def _with_context(meshes: tuple[Mesh, ...], cp: int | None, seq_len: int | None) -> tuple[Mesh, ...]:
    """Each mesh at `cp` (UsageError where it does not divide), or at each degree it takes for a long sequence."""
    if cp is not None:
        fitting = tuple(m.with_context(cp) for m in meshes if m.ep == 1 and cp in m.context_degrees())
        if not fitting:
            try:
                meshes[0].with_context(cp)
            except MeshError as exc:
                raise UsageError(str(exc)) from None
            raise UsageError(f"`cp` {cp} is not a power of two (the sequence is cut into 2 cp chunks)")
        return fitting
    if seq_len is None or seq_len < MIN_CONTEXT_SEQ:
        return meshes
    return tuple(m.with_context(c) for m in meshes for c in (m.context_degrees() if m.ep == 1 else [1]))


def _tensor_variants(settings: SearchSettings, mesh: Mesh) -> list[Mesh]:
    """Each tensor degree searched, above 1 with and without sequence parallelism (or as asked)."""
    degrees = [_tensor(mesh, settings.tp).tp] if settings.tp is not None else mesh.tensor_degrees()
    variants = (True, False) if settings.sequence_parallel is None else (settings.sequence_parallel == "on",)
    return [mesh.with_tensor(t, sp) for t in degrees for sp in ((False,) if t == 1 else variants)]


def _tensor_meshes(settings: SearchSettings, mesh: Mesh, experts: ExpertInfo) -> tuple[Mesh, ...]:
    tensor = _tensor_variants(settings, mesh)
    if settings.ep is not None:
        fitting = [m for m in tensor if m.dp % settings.ep == 0]
        if not fitting:
            ranks = ", ".join(str(d) for d in sorted({m.dp for m in tensor}))
            raise UsageError(f"`ep` {settings.ep} does not divide the data-parallel ranks of any mesh searched "
                             f"({ranks}): it borrows its groups from them")
        return tuple(m.with_experts(settings.ep) for m in fitting)
    splits = experts.n_experts if experts.runs_split else 0  # by default only what `apply` can run
    return tuple(m.with_experts(e) for m in tensor for e in m.expert_degrees(splits))


def pipeline_meshes_of(settings: PlanningSettings, mesh: Mesh) -> tuple[Mesh, ...]:
    """The pipelined meshes a search tries after the others where a pipeline may pay (mesh_search.pipeline_pays):
    with neither `pp` nor a uniform `strategy` given, on two nodes or more, stages of whole nodes (each divisor
    of the node count above 1), at tensor degree 1 and at the largest a node takes (with sequence parallelism
    unless `sequence_parallel` is off), or at `tp` where given (the mesh search adds the best plan's degree
    without a pipeline). Within a node a pipeline's bubble costs more than FSDP's collectives over its GPU
    links; `pp` fixes a degree, parts of a node included."""
    if not isinstance(settings, SearchSettings) or settings.pp is not None or mesh.nodes < 2 or settings.strategy \
            or settings.ep is not None or settings.cp is not None:
        return ()
    tensor = [settings.tp] if settings.tp is not None else sorted({1, max(mesh.tensor_degrees())})
    sp = settings.sequence_parallel != "off"
    meshes = [_pipelined(mesh.with_tensor(t, sp and t > 1), pp) for t in tensor
              for pp in mesh.with_tensor(t).pipeline_degrees() if 1 < pp <= mesh.nodes]
    return tuple(m for m in meshes if m is not None)


def _tensor(mesh: Mesh, tp: int, sequence_parallel: bool = False) -> Mesh:
    try:
        return mesh.with_tensor(tp, sequence_parallel)
    except MeshError as exc:
        raise UsageError(str(exc)) from None


def _with_pipeline(mesh: Mesh, pp: int) -> Mesh:
    try:
        return mesh.with_pipeline(pp)
    except MeshError as exc:
        raise UsageError(str(exc)) from None


def _pipelined(mesh: Mesh, pp: int) -> Mesh | None:
    try:
        return mesh.with_pipeline(pp)
    except MeshError:
        return None


def _plan_mesh(plan: Plan, cluster_mesh: Mesh) -> Mesh:
    """The plan's own degrees on the cluster asked for (the plan's unless given)."""
    planned = plan.cluster.mesh
    try:
        return (cluster_mesh.with_tensor(planned.tp, planned.sequence_parallel).with_experts(planned.ep)
                .with_context(planned.cp).with_pipeline(planned.pp))
    except MeshError as exc:
        raise UsageError(f"the plan's tensor-, expert- or context-parallel degree does not fit this cluster: {exc}") \
            from None


def _with_plan_defaults(settings: PlanningSettings, plan: Plan, plan_file: Path | None) -> PlanningSettings:
    """The settings with what they leave out taken from the plan: its cluster (unless any of gpus, nodes and
    gpus_per_node is given: then its global batch is not taken either), profile, host memory, limit,
    micro-batch, sequence length, precision, optimizer, granularity, and its model from the plan's data."""
    t, c = plan.training, plan.cluster
    cluster_given = any(v is not None for v in (settings.gpus, settings.nodes, settings.gpus_per_node))
    fields = dict(profile=c.profile, host_mem=c.host_mem_bytes, mem=c.mem_limit_bytes, batch_size=t.micro_batch_size,
                  seq_len=t.seq_len, dtype=t.dtype, optimizer=t.optimizer, granularity=t.granularity,
                  allocator_conf=c.allocator_conf)
    if not cluster_given:
        fields.update(gpus=c.world_size, nodes=c.nodes, gpus_per_node=c.gpus_per_node, global_batch=t.global_batch_size)
    if settings.model is None:  # from the plan's data: never code the plan names
        fields["model"] = model_from_plan(plan.model.name, plan.model.config, plan_file)
    given = {name: getattr(settings, name) for name in fields}
    return settings.replace(**{name: value if given[name] is None else given[name] for name, value in fields.items()})


def _uniform(settings: PlanningSettings, cluster: Cluster) -> Uniform | None:
    """The uniform strategy that replaces the solver: a search's `strategy` if given; an estimate's (default
    shard) unless it costs a plan."""
    if isinstance(settings, SearchSettings):
        return None if settings.strategy is None else Uniform(settings.strategy, settings.checkpoint, settings.offload)
    if isinstance(settings, EstimateSettings) and settings.plan is not None:
        return None
    strategy = settings.strategy or DEFAULT_SHARDING
    if SHARDING_KINDS[strategy].multi_node_only and cluster.mesh.nodes < 2:
        raise UsageError(f"`strategy` {strategy} needs more than one node (`nodes`)")
    return Uniform(strategy, checkpoint_name(settings.checkpoint), settings.offload)


def wrap_policy_of(settings: PlanningSettings):
    """The FSDP wrap policy given as `wrap_policy` or in the pins file (`wrap:`), or None; UsageError for both, or
    with a `granularity` (the policy says what the units are)."""
    policy = settings.wrap_policy or getattr(settings.pins, "wrap", None)
    if settings.wrap_policy is not None and getattr(settings.pins, "wrap", None) is not None:
        raise UsageError("give the wrap policy once: `wrap_policy`, or the `pins` file's wrap:")
    if policy is not None and settings.granularity not in (None, "root"):
        raise UsageError(f"`wrap_policy` says what the units are, in place of `granularity` {settings.granularity}")
    return policy


def _wrapped(session: TracedModel, policy) -> tuple[str, ...]:
    """The modules `policy` wraps; those that cannot be units (tied weights) are said on stderr and left out."""
    paths, refused = wrap_paths(session.module, policy)
    for why in refused:
        print(f"autoplan: note: the wrap policy {policy.text()} wraps {why}; left to its parent unit",
              file=sys.stderr)
    if not paths:
        raise UsageError(f"the wrap policy {policy.text()} wraps no module of {session.name} that can be a unit "
                         "(a smaller min_num_params, or other layer classes, would)")
    return tuple(paths)


def _tables(session: TracedModel, training: Training, settings: PlanningSettings,
            plan: Plan | None) -> tuple[CostTables, PinResolution | None]:
    """The model's cost tables at the granularity (traced here), with the units a plan's or the pins'
    modules make, and the pins resolved against them."""
    granularity, compute = settings.granularity_or_default, training.compute_dtype
    extra = tuple(unit.module for unit in plan.units) if plan is not None else ()
    if plan is None and wrap_policy_of(settings) is not None:  # a team's FSDP wrap policy: its units
        extra += _wrapped(session, wrap_policy_of(settings))
    pins = None
    if settings.pin_set is not None:  # matched once against the granularity's units; modules they name become units
        base = session.cache(compute, granularity, extra)
        pins = resolve_pins(settings.pin_set, [unit.path for unit in base.units], session.module, session.name)
        if plan is not None and pins.extra_units:
            raise UsageError(f"pins that make modules units ({', '.join(pins.extra_units[:3])}) cannot change a "
                             "`plan`: it has no decision for them; search again with the pins")
        extra += pins.extra_units
    return session.cache(compute, granularity, extra), pins
