"""Notice sources: one per channel (AWS, GCP, Azure metadata; our own SIGTERM).

Each source is an async iterator of :class:`Notice` (see ``model.py``); the responder
consumes Notices and knows no cloud. ``make_source`` picks the metadata source from the
``[preemption]`` config; the service adds a :class:`SigtermSource` beside it.
"""

from ckptd.notices.aws import AwsImdsSource
from ckptd.notices.azure import AzureScheduledEventsSource
from ckptd.notices.detect import detect_cloud, make_source
from ckptd.notices.gcp import GcpMetadataSource
from ckptd.notices.model import KNOWN_KINDS, Notice, NoticeSource, format_time, parse_time
from ckptd.notices.sigterm import SigtermSource

__all__ = [
    "KNOWN_KINDS",
    "AwsImdsSource",
    "AzureScheduledEventsSource",
    "GcpMetadataSource",
    "Notice",
    "NoticeSource",
    "SigtermSource",
    "detect_cloud",
    "format_time",
    "make_source",
    "parse_time",
]
