{{/*
The alert rules, as a Prometheus rules file's `groups`. Rendered into the PrometheusRule;
tests render them into a plain rules file for `promtool check rules` and `promtool test rules`
(charts/kubetrain/tests/alerts_test.yaml).
*/}}
{{- define "kubetrain.alertGroups" -}}
- name: kubetrain.rules
  rules:
  - alert: KubetrainOperatorDown
    expr: absent(kubetrain_operator_jobs)
    for: 5m
    labels:
      severity: critical
    annotations:
      summary: The kubetrain operator is not being scraped
      description: No kubetrain_operator_* metrics for 5 minutes; TrainingJobs are not reconciled (no gang restarts, no TTL cleanup).
  - alert: KubetrainJobFailed
    expr: sum by (reason) (increase(kubetrain_operator_jobs_finished_total{phase="Failed"}[10m])) > 0
    labels:
      severity: warning
    annotations:
      summary: TrainingJobs failed (reason {{ "{{" }} $labels.reason {{ "}}" }})
      description: '{{ "{{" }} $value | humanize {{ "}}" }} TrainingJob(s) finished Failed with reason {{ "{{" }} $labels.reason {{ "}}" }} in the last 10 minutes; see `kubectl get tj` and `kubectl describe tj`.'
  - alert: KubetrainRestartStorm
    expr: sum by (reason) (increase(kubetrain_operator_gang_restarts_total[30m])) >= {{ .Values.metrics.prometheusRule.restartStormThreshold }}
    labels:
      severity: warning
    annotations:
      summary: Repeated gang restarts (reason {{ "{{" }} $labels.reason {{ "}}" }})
      description: '{{ "{{" }} $value | humanize {{ "}}" }} whole-gang restarts caused by {{ "{{" }} $labels.reason {{ "}}" }} in 30 minutes: a bad node, a bad image or a crashing job.'
  - alert: KubetrainJobNoProgress
    expr: max by (namespace, job) (changes(kubetrain_trainer_step[{{ .Values.metrics.prometheusRule.noProgressFor }}])) == 0 and max by (namespace, job) (kubetrain_trainer_step) > 0
    for: 1m
    labels:
      severity: warning
    annotations:
      summary: TrainingJob {{ "{{" }} $labels.job {{ "}}" }} makes no progress
      description: The optimizer step of {{ "{{" }} $labels.job {{ "}}" }} has not moved for {{ .Values.metrics.prometheusRule.noProgressFor }} (hung collective, stalled data loader or stuck checkpoint).
{{- end -}}
