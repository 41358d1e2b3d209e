"""Trace loading: Kineto chrome traces (files, directories, servprof sessions) as numpy columns."""

from servprof.trace.errors import TraceError
from servprof.trace.loader import load_trace
from servprof.trace.model import Trace
from servprof.trace.phases import PhaseEvent, phase_events, request_phases

__all__ = ["Trace", "TraceError", "load_trace", "request_phases", "phase_events", "PhaseEvent"]
