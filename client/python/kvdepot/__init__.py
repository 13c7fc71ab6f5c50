"""kvdepot: the Python client of kvdepot, over libkvdepot.

    import numpy as np, kvdepot
    with kvdepot.Client("127.0.0.1:50051") as c:
        c.put_model(kvdepot.Model("m", num_layers=2, num_kv_heads=8, head_dim=128))
        c.create_sequence("req-1", "m")
        k = np.zeros((2, 16, 8, 128), np.float16)
        c.append("req-1", k, k, token_start=0)
        k2, v2 = c.read("req-1")
"""
from .client import (ARTIFACT_KINDS, Artifact, AttendResult, CalibrateResult, CalibrationError,
                     Client, CodecAdvice, CodecChoice, CodecEvaluation, Codecs, LayerAdvice, EngineHashes, FetchPlan, HeadTokens, Model, SequenceInfo,
                     Transfer, attention_local, attention_merge, encode_pages, prefix_hashes,
                     transfer_threads)
from .errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded,
                     FailedPrecondition, Internal, InvalidArgument, KvdepotError, NotFound,
                     OutOfRange, PermissionDenied, ResourceExhausted, Unauthenticated,
                     Unavailable, Unimplemented, Unknown)

__all__ = [
    "Client", "Model", "SequenceInfo", "AttendResult", "Codecs", "HeadTokens", "FetchPlan",
    "EngineHashes", "Transfer", "Artifact", "ARTIFACT_KINDS", "CalibrateResult",
    "CalibrationError", "CodecAdvice", "CodecChoice", "CodecEvaluation", "LayerAdvice",
    "prefix_hashes", "encode_pages", "attention_local", "attention_merge",
    "transfer_threads", "KvdepotError", "Cancelled", "Unknown",
    "InvalidArgument", "DeadlineExceeded", "NotFound", "AlreadyExists", "PermissionDenied",
    "ResourceExhausted", "FailedPrecondition", "Aborted", "OutOfRange", "Unimplemented",
    "Internal", "Unavailable", "DataLoss", "Unauthenticated",
]
__version__ = "0.1.0"
