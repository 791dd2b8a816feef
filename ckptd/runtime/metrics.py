"""Every Prometheus metric ckptd exports, with its help text. Names are a contract
(docs/design.md, "HTTP"); labelled by ``run`` where it applies.

A ``Metrics`` owns its own registry so tests (and several daemons in one process)
never share counters. Counters an alert takes ``increase()`` of have closed label sets,
created at 0 when their run is known (``init_run``): a series born at 1 has no earlier
sample, so ``increase()`` would miss the first failure.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Checkpoints run from MiB to TiB, and a commit takes from well under a second to hours.
SIZE_BUCKETS = tuple(float(2**p) for p in range(20, 42, 2))  # 1 MiB .. 2 TiB
RESTART_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400)

# ckptd_checkpoints_failed_total{reason}: why a checkpoint was not committed. The store's
# own error code is in the ``checkpoint_failed`` log line, not in a label.
FAILURE_REASONS = (
    "unusable",  # the store refuses this node: credentials, access, no such bucket
    "verify",  # what was read back does not match what was sent
    "storage",  # any other error of the store, after retries
    "conflict",  # the name is taken by other content, or two nodes' parts disagree
    "local",  # reading the checkpoint here failed, or its manifest would not build
)
# ckptd_storage_errors_total{kind}.
STORAGE_ERROR_KINDS = ("unusable", "verify", "transient", "permanent")


class PeerMetrics:
    """Peer replication's metrics (``ckptd.peers``; docs/peers.md): a family of
    ``Metrics``, which registers them last, on its registry. Set on the instance like
    the rest (``metrics.peer_pushes``), so a ``Metrics`` lists every metric it holds."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.peer_pushes = Counter(
            "ckptd_peer_pushes",
            "Parts pushed to a peer, by outcome (acknowledged, or why not: refused reasons,"
            " unreachable, restarted, changed).",
            ["run", "outcome"],
            registry=r,
        )
        self.peer_sent_bytes = Counter(
            "ckptd_peer_sent_bytes", "Bytes of checkpoint data sent to peers.", registry=r
        )
        self.peer_received_bytes = Counter(
            "ckptd_peer_received_bytes",
            "Bytes of other nodes' parts received and verified chunk by chunk.",
            registry=r,
        )
        self.peer_served_bytes = Counter(
            "ckptd_peer_served_bytes", "Bytes served to restores on other nodes.", registry=r
        )
        self.peer_refused = Counter(
            "ckptd_peer_refused",
            "Requests the peer port refused, by reason (unauthorized, corrupt, quota,"
            " unknown, changed, bad_request).",
            ["reason"],
            registry=r,
        )
        self.peer_replicas_sealed = Counter(
            "ckptd_peer_replicas_sealed",
            "Other nodes' parts received whole, verified and fsynced (acknowledged).",
            registry=r,
        )
        self.peer_replicas_held = Gauge(
            "ckptd_peer_replicas_held", "Replicas of other nodes' parts held here.", registry=r
        )
        self.peer_replica_bytes = Gauge(
            "ckptd_peer_replica_bytes", "Bytes of the replicas held here.", registry=r
        )
        self.peer_quota_bytes = Gauge(
            "ckptd_peer_quota_bytes", "The replicas' disk quota (peers.quota_gib).", registry=r
        )
        self.peers_known = Gauge(
            "ckptd_peers_known",
            "Other nodes of the run whose peer announcement is fresh in the store.",
            registry=r,
        )
        self.peer_replication_seconds = Histogram(
            "ckptd_peer_replication_seconds",
            "From a part complete to acknowledged by peers.copies peers.",
            ["run"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.emergency_safe_seconds = Gauge(
            "ckptd_emergency_safe_seconds",
            "Seconds from the last notice to its emergency checkpoint safe off the node, by"
            " the way it first was (peer: acknowledged by peers.copies peers; store:"
            " committed); 0 until then.",
            ["via"],
            registry=r,
        )
        self.peer_handoffs = Counter(
            "ckptd_peer_handoffs",
            "Dead nodes' parts this node put in the store in their name, by outcome"
            " (committed: part written; refused: a replica that failed its checks or a"
            " save no longer announced; failed: the store).",
            ["run", "outcome"],
            registry=r,
        )


class Metrics(PeerMetrics):
    """The daemon's metrics on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.committed = Counter(
            "ckptd_checkpoints_committed",
            "Checkpoints committed (manifest written).",
            ["run"],
            registry=r,
        )
        self.failed = Counter(
            "ckptd_checkpoints_failed",
            "Checkpoint uploads that failed, by reason (unusable, verify, storage, conflict, local);"
            " retried with backoff, except a conflict.",
            ["run", "reason"],
            registry=r,
        )
        self.abandoned = Counter(
            "ckptd_checkpoints_abandoned",
            "Checkpoints changed or deleted locally while uploading; never committed.",
            ["run"],
            registry=r,
        )
        self.upload_bytes = Counter(
            "ckptd_upload_bytes", "Bytes of checkpoint data sent to the store.", ["run"], registry=r
        )
        self.copied_bytes = Counter(
            "ckptd_copied_bytes",
            "Bytes of unchanged files copied server-side instead of uploaded.",
            ["run"],
            registry=r,
        )
        self.upload_duration = Histogram(
            "ckptd_upload_duration_seconds",
            "From checkpoint complete to committed.",
            ["run"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.checkpoint_bytes = Histogram(
            "ckptd_checkpoint_size_bytes",
            "Size of committed checkpoints.",
            ["run"],
            buckets=SIZE_BUCKETS,
            registry=r,
        )
        self.pending = Gauge(
            "ckptd_pending_checkpoints",
            "Complete checkpoints not yet committed.",
            ["run"],
            registry=r,
        )
        self.last_step = Gauge(
            "ckptd_last_committed_step",
            "Step of the newest committed checkpoint.",
            ["run"],
            registry=r,
        )
        self.last_commit_ts = Gauge(
            "ckptd_last_commit_timestamp_seconds",
            "Unix time of the last commit.",
            ["run"],
            registry=r,
        )
        self.seconds_without_commit = Gauge(
            "ckptd_seconds_without_commit",
            "Seconds since the run's last commit, or since the daemon began watching it.",
            ["run"],
            registry=r,
        )
        self.advised_interval = Gauge(
            "ckptd_advised_checkpoint_interval_seconds",
            "Advised training time between checkpoints (Young/Daly, from measured save "
            "cost and interruption rate; GET /v1/advice).",
            ["run"],
            registry=r,
        )
        self.sync_lag = Gauge(
            "ckptd_sync_lag_seconds",
            "Age of the oldest complete checkpoint not yet committed (0 when none).",
            ["run"],
            registry=r,
        )
        self.preemption_notice = Gauge(
            "ckptd_preemption_notice", "1 while a preemption notice is active.", registry=r
        )
        self.preemption_deadline = Gauge(
            "ckptd_preemption_deadline_seconds",
            "Unix time of the active notice's deadline (0 when none or unknown).",
            registry=r,
        )
        self.notice_source_up = Gauge(
            "ckptd_notice_source_up",
            "1 while the notice source reads what it asks: the cloud's metadata service, "
            "or Slurm's controller for the job (source=slurm); 0 until the first read, and "
            "from the first failed one.",
            ["source"],
            registry=r,
        )
        self.notice_source_last_success = Gauge(
            "ckptd_notice_source_last_success_timestamp_seconds",
            "Unix time of the notice source's last successful read (0: none yet).",
            ["source"],
            registry=r,
        )
        self.notice_source_failures = Gauge(
            "ckptd_notice_source_consecutive_failures",
            "Failed reads of the notice source since its last success.",
            ["source"],
            registry=r,
        )
        self.trainer_signal_skipped = Counter(
            "ckptd_trainer_signal_skipped",
            "Matched trainer processes not sent the save signal: no handler for it.",
            registry=r,
        )
        self.emergency_eta = Gauge(
            "ckptd_emergency_flush_eta_seconds",
            "Estimated seconds until pending emergency work is committed, at the measured rate.",
            registry=r,
        )
        self.upload_rate = Gauge(
            "ckptd_upload_rate_bytes_per_second",
            "Upload rate over the last 10 s (drives the flush ETA).",
            registry=r,
        )
        self.retries = Counter(
            "ckptd_retries",
            "Storage operations retried after a transient error.",
            ["operation"],
            registry=r,
        )
        self.storage_errors = Counter(
            "ckptd_storage_errors",
            "Storage operations that failed for good (after retries, or permanent), by kind"
            " (unusable, verify, transient, permanent).",
            ["operation", "kind"],
            registry=r,
        )
        self.destination_up = Gauge(
            "ckptd_destination_up", "1 when the last destination check succeeded.", registry=r
        )
        self.waiting_for_nodes = Gauge(
            "ckptd_checkpoints_waiting_for_nodes",
            "Many nodes: checkpoints whose part this node wrote, waiting for other nodes' parts.",
            ["run"],
            registry=r,
        )
        self.unshippable = Counter(
            "ckptd_unshippable_entries",
            "Entries of a checkpoint that cannot be shipped (dangling symlink, link to a "
            "directory, special file); such a checkpoint is never committed.",
            ["run"],
            registry=r,
        )
        self.cluster_conflicts = Counter(
            "ckptd_cluster_conflicts",
            "Many nodes: checkpoints never committed because two nodes' parts differ on a file.",
            ["run"],
            registry=r,
        )
        # `ckptd exec`: the supervised trainer (docs/exec.md).
        self.trainer_starts = Counter(
            "ckptd_trainer_starts", "Times the supervised trainer was started.", ["run"], registry=r
        )
        self.trainer_restarts = Counter(
            "ckptd_trainer_restarts",
            "Supervised trainer restarts after a failure, by cause (exit:N, signal:NAME).",
            ["run", "cause"],
            registry=r,
        )
        self.trainer_restart_seconds = Histogram(
            "ckptd_trainer_restart_seconds",
            "From the trainer's failure seen to its successor started (backoff included).",
            ["run"],
            buckets=RESTART_BUCKETS,
            registry=r,
        )
        self.trainer_running = Gauge(
            "ckptd_trainer_running", "1 while the supervised trainer runs.", ["run"], registry=r
        )
        self.goodput_ratio = Gauge(
            "ckptd_goodput_ratio",
            "Productive training time over wall time since the run started (ckptd exec, or "
            "ckptd run beside the trainer; the run ledger, docs/goodput.md).",
            ["run"],
            registry=r,
        )
        self.badput_seconds = Gauge(
            "ckptd_badput_seconds_total",
            "Seconds of the run by cause (productive and unknown included; they sum to the "
            "wall time). A gauge: a later record may reclassify time, e.g. as lost.",
            ["run", "cause"],
            registry=r,
        )
        self.journal_rows = Gauge(
            "ckptd_journal_rows", "Rows in the resume journal, by table.", ["table"], registry=r
        )
        self.cluster_notices = Counter(
            "ckptd_cluster_notices",
            "Cluster NOTICE events (many nodes): published, publish_failed (retried), followed.",
            ["run", "event"],
            registry=r,
        )

        # The drill (docs/preemption.md "The drill"): its gauges come from the run's drill
        # records in the store, so every node and a restarted daemon agree.
        self.drills = Counter(
            "ckptd_drills",
            "Drills this daemon ran, by result (success, failure).",
            ["run", "result"],
            registry=r,
        )
        self.drill_last_success = Gauge(
            "ckptd_drill_last_success_timestamp_seconds",
            "Unix time the run's last successful drill ended (0: none among its last "
            "[drill] history drills); from the store, once the run has a drill.",
            ["run"],
            registry=r,
        )
        self.drill_last_failure = Gauge(
            "ckptd_drill_last_failure_timestamp_seconds",
            "Unix time the run's last failed drill ended (0: none among its last [drill] "
            "history drills); from the store, once the run has a drill.",
            ["run"],
            registry=r,
        )
        self.drill_success_ratio = Gauge(
            "ckptd_drill_success_ratio",
            "Share of the run's last [drill] history drills that passed, every kind "
            "(restore-only ones included); from the store, once the run has a drill.",
            ["run"],
            registry=r,
        )
        self.drill_resume_success_ratio = Gauge(
            "ckptd_drill_resume_success_ratio",
            "Share of the run's last [drill] history drills that asked the trainer to resume "
            "(ckptd drill --restore-only --resume-steps) that passed; from the store, once "
            "the run has one.",
            ["run"],
            registry=r,
        )
        self.drill_last_resume_success = Gauge(
            "ckptd_drill_last_resume_success_timestamp_seconds",
            "Unix time the run's last drill whose trainer resumed for its steps ended (0: "
            "none among its last [drill] history drills); once the run has one.",
            ["run"],
            registry=r,
        )
        self.drill_periods_missed = Gauge(
            "ckptd_drill_periods_missed",
            "Periods in a row of the run's drill schedule ([drill] every) that ended with "
            "their drill never started (0 once one starts); only with a schedule.",
            ["run"],
            registry=r,
        )
        self.drill_stage_seconds = Gauge(
            "ckptd_drill_stage_seconds",
            "Each stage of the run's last drill, its own duration (signalled, complete, "
            "committed, restored, verified, loaded).",
            ["run", "stage"],
            registry=r,
        )
        # Several destinations (docs/tiers-and-retention.md): each tier counted on its own; the
        # unlabelled metrics above are the first tier's.
        self.tier_committed = Counter(
            "ckptd_tier_checkpoints_committed",
            "Checkpoints committed to this tier (its own manifest written and verified).",
            ["run", "tier"],
            registry=r,
        )
        self.tier_failed = Counter(
            "ckptd_tier_checkpoints_failed",
            "Attempts to commit a checkpoint to this tier that failed (retried with backoff).",
            ["run", "tier"],
            registry=r,
        )
        self.tier_pending = Gauge(
            "ckptd_tier_pending_checkpoints",
            "Complete checkpoints not yet committed to this tier (its backlog).",
            ["run", "tier"],
            registry=r,
        )
        self.tier_last_commit_ts = Gauge(
            "ckptd_tier_last_commit_timestamp_seconds",
            "Unix time of the last commit to this tier.",
            ["run", "tier"],
            registry=r,
        )
        self.tier_last_step = Gauge(
            "ckptd_tier_last_committed_step",
            "Step of the newest checkpoint committed to this tier.",
            ["run", "tier"],
            registry=r,
        )
        self.tier_up = Gauge(
            "ckptd_tier_up",
            "1 when the last check of this tier's destination succeeded; a failed request to"
            " it has it checked again at once.",
            ["tier"],
            registry=r,
        )
        self.task_failures = Counter(
            "ckptd_task_failures",
            "Failures of the daemon's background tasks (each logged as task_failed, then"
            " retried or restarted), by task.",
            ["task"],
            registry=r,
        )
        # Health sources (ckptd.health; docs/health.md).
        self.health_events = Counter(
            "ckptd_health_events",
            "Health events heard (an Xid, an OOM kill, an I/O error, memory pressure, a disk"
            " too full for the next save, the store lost), by source, kind and severity.",
            ["source", "kind", "severity"],
            registry=r,
        )
        self.health_actions = Counter(
            "ckptd_health_actions",
            "What health events did: save, defer (a save held until the save in progress"
            " is over), save-and-stop, report (a save held back by the rate limit"
            " included), ignore.",
            ["action"],
            registry=r,
        )
        self.node_healthy = Gauge(
            "ckptd_node_healthy",
            "0 while a degrading or fatal health condition lasts, or after a degrading or"
            " fatal fault until the daemon restarts; 1 otherwise (always, with [health] off).",
            registry=r,
        )
        self.node_healthy.set(1)
        self.health_source_up = Gauge(
            "ckptd_health_source_up",
            "1 when the health source (kmsg, psi, cgroup) was read at its last poll.",
            ["source"],
            registry=r,
        )
        self.health_io_latency = Gauge(
            "ckptd_health_disk_io_latency_seconds",
            "Mean time per I/O completed on the device of the run's watch dir over the last"
            " health poll (/proc/diskstats); absent for a device not listed there (tmpfs, NFS).",
            ["run"],
            registry=r,
        )
        self.health_fs_free_bytes = Gauge(
            "ckptd_health_fs_free_bytes",
            "Free bytes on the filesystem of the run's watch dir, as the health source read it.",
            ["run"],
            registry=r,
        )
        self.loss_spikes = Counter(
            "ckptd_loss_spikes",
            "Loss spikes the trainer reported (report_step(step, loss=...)), by kind: spike"
            " (a z-score over the window), non-finite; one per episode (docs/health.md).",
            ["run", "kind"],
            registry=r,
        )
        self.protected_checkpoints = Gauge(
            "ckptd_protected_checkpoints",
            "Checkpoints of the run this daemon keeps from retention as a loss spike's"
            " rollback target, now.",
            ["run"],
            registry=r,
        )
        # -- peer replication (ckptd.peers; docs/peers.md): ``PeerMetrics``, last --------
        super().__init__(r)

    def init_run(self, run: str) -> None:
        """Every series an alert watches, at 0, for a run this daemon ships."""
        for reason in FAILURE_REASONS:
            self.failed.labels(run=run, reason=reason)
        for kind in STORAGE_ERROR_KINDS:
            self.storage_errors.labels(operation="checkpoint", kind=kind)
        for counter in (self.committed, self.abandoned, self.upload_bytes):
            counter.labels(run=run)

    def init_tier(self, run: str, tier: str) -> None:
        """A tier's counters, at 0, for a run this daemon ships to it."""
        for counter in (self.tier_committed, self.tier_failed):
            counter.labels(run=run, tier=tier)

    def failures_of(self, run: str) -> dict[str, int]:
        """``ckptd_checkpoints_failed_total`` of ``run`` by reason, as exported (the
        reasons with none left out): what ``/v1/status`` shows is the metric itself."""
        found: dict[str, int] = {}
        for family in self.failed.collect():
            for sample in family.samples:
                labels = sample.labels
                if sample.name.endswith("_total") and labels.get("run") == run and sample.value:
                    found[labels["reason"]] = int(sample.value)
        return found

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return bytes(generate_latest(self.registry))
