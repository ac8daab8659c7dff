"""The broker's ops surface for operators: `/metrics`, `/api/...` and a live dashboard page.

`create_ops_app(view, metrics, auth)` builds the aiohttp application over an `OpsView` (the
broker's read-only snapshot of nodes, deployments and migrations), a `BrokerMetrics` and an
`OpsAuth` (the ops token: who may read it).
"""

from broker.ops.app import create_ops_app, create_standby_app, start_ops_server
from broker.ops.auth import OpsAuth
from broker.ops.metrics import (
    BrokerMetrics,
    DeploymentFigures,
    MetricFigures,
    NodeFigures,
    ServiceClientFigures,
    ServiceFigures,
)
from broker.ops.view import (
    BatchingInfo,
    DeploymentInfo,
    DeploymentLoadInfo,
    GpuInfo,
    LinkInfo,
    LoadInfo,
    MigrationInfo,
    NodeInfo,
    NodeLoadInfo,
    OffloadDecisionInfo,
    OffloadInfo,
    OpsView,
    PrewarmInfo,
    ResizeInfo,
    ScaleDecisionInfo,
    ServiceClientInfo,
    ServiceInfo,
    ServiceReplicaInfo,
    StandbyInfo,
    TimelineEvent,
)

__all__ = [
    "BatchingInfo",
    "BrokerMetrics",
    "DeploymentFigures",
    "DeploymentInfo",
    "DeploymentLoadInfo",
    "GpuInfo",
    "LinkInfo",
    "LoadInfo",
    "MetricFigures",
    "MigrationInfo",
    "NodeFigures",
    "NodeInfo",
    "NodeLoadInfo",
    "OffloadDecisionInfo",
    "OffloadInfo",
    "OpsAuth",
    "OpsView",
    "PrewarmInfo",
    "ResizeInfo",
    "ScaleDecisionInfo",
    "ServiceClientFigures",
    "ServiceClientInfo",
    "ServiceFigures",
    "ServiceInfo",
    "ServiceReplicaInfo",
    "StandbyInfo",
    "TimelineEvent",
    "create_ops_app",
    "create_standby_app",
    "start_ops_server",
]
