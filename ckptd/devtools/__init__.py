"""The demo and the embedded loopback S3 server (SeaweedFS) it, the tests and the
benchmarks use."""
