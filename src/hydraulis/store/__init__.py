"""What runs keep on disk, without torch: checkpoint directories and their manifests (checkpoints.py), where a
resume starts (resume.py) and the shared cache of measured profiles (profile_cache.py).

Below `runtime/`, so that the runtime's storage and metering and the training job all read them from here.
"""
