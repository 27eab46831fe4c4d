"""Record types and explicit Arrow schemas at every stage boundary.

Imports: stdlib and pyarrow only. Every writer passes one of these schemas; nothing infers a schema from data.
"""
