"""MLflow as a view of the receipts: one parent run per sweep, one nested child run per arm.

Nothing here is imported by ``import ablate``: MLflow and matplotlib load only when a sweep or a sync runs.
"""
