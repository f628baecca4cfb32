"""The randomized fault campaign (docs/fault-campaign.md): the checker finds 0 anomalies, or the failure reports each
one by kind with the operations involved, the seed that replays the run and the replicas' logs."""

from __future__ import annotations

import json
import os

import pytest

from tests.campaign.campaign import Plan, run_campaign
from tests.campaign.cluster import running_cluster

# The replicas seal content at rest (docs/encryption.md) unless STATESTORE_CAMPAIGN_ENCRYPTION=off: the rest of
# the suite runs in clear, so the campaign's faults meet the sealed paths.
ENCRYPTION = os.environ.get("STATESTORE_CAMPAIGN_ENCRYPTION", "on") != "off"


@pytest.mark.timeout(900 if os.environ.get("STATESTORE_CAMPAIGN") == "full" else 170)
async def test_campaign_finds_no_anomaly(campaign_plan: Plan) -> None:
    with running_cluster(replicas=3, encryption=ENCRYPTION) as cluster:
        report = await run_campaign(cluster, campaign_plan)
        print(report.summary(), flush=True)
        assert not report.anomalies, (
            report.summary() + "\n" + json.dumps(report.anomalies.found, indent=1)[:20000] + "\n" + cluster.logs()
        )
    assert report.faults >= campaign_plan.min_faults // 2, report.summary()
    assert report.outcomes.get("ok", 0) >= report.ops // 3, report.summary()
