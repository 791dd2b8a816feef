"""The vocabulary every other part speaks: errors, the manifest, checksums, digests,
signing, and the files the daemon and the trainer share under ``<watch>/.ckptd/``."""
