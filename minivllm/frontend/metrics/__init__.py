"""Engine metrics: request timings and token counts read off the engine-core output stream
(`stats.StatsCollector`), logged every few seconds (`loggers.LoggingStatLogger`) and exported
to Prometheus under vLLM's names (`prometheus.PrometheusStatLogger`)."""
