"""What a campaign's settings must satisfy, checked before anything starts or is written:
the settings themselves (:func:`check_spec`), the aggregator's HE context
(:func:`check_public_context`), the consortium and the output directory (:func:`preflight`)
and a DP campaign's noise and length (:func:`plan_dp`). Run by both runtimes (simulation and
``--superlink``) and by ``campaign resume``.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

from sealfl.clients.plugins import get_task
from sealfl.common.errors import SealflError
from sealfl.common.seconds import MAX_SECONDS, is_seconds
from sealfl.he import codecs
from sealfl.he.server_opt import ServerOpt
from sealfl.platform.consortium import Consortium
from sealfl.platform.errors import CampaignError
from sealfl.server.bookkeeping import CampaignDir

if TYPE_CHECKING:
    from sealfl.platform.campaign import CampaignSpec

log = logging.getLogger(__name__)

__all__ = ["MAX_ROUNDS", "check_spec", "check_public_context", "preflight", "plan_dp"]


#: most rounds one campaign may ask for (Flower's own examples run tens to hundreds)
MAX_ROUNDS = 100_000


def check_spec(spec: CampaignSpec, num_partners: int, min_partners: int) -> None:
    """Refuse settings that cannot work, before Ray starts. Raises CampaignError."""
    if not 1 <= min_partners <= num_partners:
        raise CampaignError(f"min_partners={min_partners} but the consortium has {num_partners} partners")
    if spec.rounds > MAX_ROUNDS:
        raise CampaignError(f"rounds={spec.rounds} is more than {MAX_ROUNDS:,} (a typo? each round sends every "
                            "partner a message and writes a checkpoint); ask for fewer")
    if spec.rounds < 1 or (spec.local_epochs is not None and spec.local_epochs < 1) \
            or (spec.batch_size is not None and spec.batch_size < 1):
        raise CampaignError("rounds, local epochs and batch size must be at least 1")
    if spec.lr is not None and not (math.isfinite(spec.lr) and spec.lr > 0):
        raise CampaignError(f"learning rate must be a positive finite number, got {spec.lr}")
    if isinstance(spec.max_examples, bool) or not isinstance(spec.max_examples, int) or spec.max_examples < 1:
        raise CampaignError(f"max_examples must be a positive integer, got {spec.max_examples!r}")
    if not is_seconds(spec.timeout_s):
        raise CampaignError(f"the reply timeout must be a number of seconds in (0, {MAX_SECONDS:g}], "
                            f"got {spec.timeout_s!r}")
    if not (math.isfinite(spec.cpus_per_partner) and spec.cpus_per_partner > 0):
        raise CampaignError(f"cpus per partner (--cpus-per-partner) must be a positive finite number, "
                            f"got {spec.cpus_per_partner}")
    mu = spec.proximal_mu
    if mu is not None and (isinstance(mu, bool) or not isinstance(mu, (int, float)) or not 0 <= mu <= 1e3
                           or not math.isfinite(mu)):
        raise CampaignError(f"proximal mu must be a finite number in [0, 1000], got {mu!r}")
    if not isinstance(spec.server_opt, ServerOpt):
        raise CampaignError(f"server_opt must be a ServerOpt, got {type(spec.server_opt).__name__}")
    if not isinstance(spec.extra, dict):
        raise CampaignError(f"extra settings must be a dict, got {type(spec.extra).__name__}")
    stray = sorted(k for k in spec.extra if isinstance(k, str) and k.startswith("server-") and k != "server-round")
    if stray:
        raise CampaignError(f"server optimizer settings {stray} go in server_opt (CLI: --server-opt, --server-lr, "
                            "--server-momentum), not in the extra settings")


def check_public_context(cons: Consortium) -> None:
    """The aggregator's HE context parses as the consortium's (parameters and context id) and
    holds no secret key -- what the ServerApp checks again first thing, here before Ray starts.
    Raises CampaignError naming the file."""
    path = cons.public_context
    try:
        codec = codecs.from_bytes(path.read_bytes(), cons.he_params, bytes.fromhex(cons.context_id))
    except (OSError, ValueError, SealflError) as exc:  # CiphertextError is a SealflError
        raise CampaignError(f"the aggregator's HE context {path} is unusable ({exc}); restore it from the "
                            "consortium's backup or create the consortium again") from exc
    if codec.has_secret_key:
        raise CampaignError(f"the aggregator's HE context {path} holds a secret key; the aggregator must never "
                            "have one: restore the public context")


def preflight(spec: CampaignSpec) -> tuple[Consortium, int]:
    """Everything that can be checked before Ray starts. Returns (consortium, min_partners).

    Raises ConsortiumError or CampaignError with what is wrong.
    """
    cons = Consortium.load(spec.consortium_dir)
    check_public_context(cons)
    n = len(cons.partners)
    min_partners = spec.min_partners if spec.min_partners is not None else max(2, n - 1)
    check_spec(spec, n, min_partners)
    if spec.dp is not None:
        spec.dp_round_config = plan_dp(spec, cons, min_partners)
    if spec.proximal_mu and "proximal-mu" not in get_task(cons.task).train_defaults():
        raise CampaignError(f"the {cons.task} task has no FedProx proximal term; leave out --proximal-mu")
    out, cdir = Path(spec.out_dir).resolve(), cons.dir.resolve()
    if out == cdir or cdir in out.parents or out in cdir.parents:
        raise CampaignError(f"the campaign directory {spec.out_dir} overlaps the consortium directory; keep them apart")
    if out.exists() and not out.is_dir():
        raise CampaignError(f"{spec.out_dir} is a file; give a directory for the campaign")
    cd = CampaignDir(out)
    if cd.exists() and not spec.overwrite:
        raise CampaignError(f"{spec.out_dir} already holds a campaign (a release may have been built from it); "
                            "choose a new --out or pass --overwrite")
    return cons, min_partners


def plan_dp(spec: CampaignSpec, cons: Consortium, min_partners: int) -> dict:
    """Check a DP campaign's settings and fix its noise and length: the noise multiplier
    (given, or calibrated so that ``spec.rounds`` rounds fit ``--dp-epsilon``) and the rounds
    (cut to the last one within the budget: the campaign stops before the round that would
    exceed it). Returns the round-config entries (``dp-*``) and sets ``spec.rounds``.
    Raises CampaignError naming the setting."""
    from sealfl.he.dp import DPConfig
    from sealfl.he.dp_account import calibrate_noise_multiplier, check_budget, epsilon
    from sealfl.he.errors import PrivacyError

    d = spec.dp
    task = get_task(cons.task)
    if not hasattr(task, "dp_gradient_sum"):
        raise CampaignError(f"the {cons.task} task has no DP training yet; leave out the --dp-* options")
    if cons.he_params.to_dict().get("scheme") != "BFV":
        raise CampaignError("DP noise lives in packed BFV's integers: this consortium uses "
                            f"{cons.he_params.to_dict().get('scheme')}; create it with --he bfv")
    if spec.server_opt.to_config().get("server-opt", "fedavg") != "fedavg":
        raise CampaignError("DP campaigns run FedAvg at the key holders; leave out --server-opt")
    try:
        check_budget(d.epsilon, d.delta)
        if d.noise_multiplier is None and d.epsilon is None:
            raise PrivacyError("DP needs --dp-epsilon (the noise is calibrated to it) or --dp-noise-multiplier")
        z = d.noise_multiplier
        if z is None:
            z = calibrate_noise_multiplier(d.epsilon, d.delta, d.sampling_rate, spec.rounds)
        cfg = DPConfig(z, d.clip, min_partners, d.trust, d.sampling_rate)
        if d.epsilon is not None and epsilon(z, [d.sampling_rate] * spec.rounds, d.delta) > d.epsilon:
            lo, hi = 0, spec.rounds  # the largest round count within the budget: ε grows with rounds
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if epsilon(z, [d.sampling_rate] * mid, d.delta) <= d.epsilon:
                    lo = mid
                else:
                    hi = mid - 1
            if lo == 0:
                raise PrivacyError(f"one round at noise multiplier {z:g} and sampling rate {d.sampling_rate:g} already "
                                   f"exceeds epsilon {d.epsilon:g}; raise the noise or lower the sampling rate")
            log.warning("DP: the campaign stops after round %d of %d: round %d would exceed epsilon %g",
                        lo, spec.rounds, lo + 1, d.epsilon)
            spec.rounds = lo
    except PrivacyError as exc:
        raise CampaignError(str(exc)) from exc
    out = {**cfg.to_config(), "dp-delta": float(d.delta)}
    if d.epsilon is not None:
        out["dp-epsilon"] = float(d.epsilon)
    return out
