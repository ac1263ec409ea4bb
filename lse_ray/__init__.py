"""LSE replicas on Ray Serve behind one endpoint (the ``ray`` extra; docs/scale-out.md)."""
