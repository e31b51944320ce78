/** Small formatters shared by the panel and the details view, and their label/value lists. */

export function duration(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) {
    return '–';
  }
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const r = s % 60;
  return h ? `${h}h${String(m).padStart(2, '0')}m` : `${m}m${String(r).padStart(2, '0')}s`;
}

export function number(value: number | null | undefined, digits = 4): string {
  return value === null || value === undefined ? '–' : value.toPrecision(digits);
}

/** Money as it is billed, in cents: '' for nothing (no price set), '< 0.01 CNY' below a cent. */
export function money(value: number | null | undefined, currency: string | null): string {
  if (value === null || value === undefined || value === 0) {
    return '';
  }
  const text = value > 0 && value < 0.01 ? '< 0.01' : value.toFixed(2);
  return `${text} ${currency || ''}`.trim();
}

/** A run's bill as the server wrote it (workbench.runs.money: '0.42 CNY', 'free', 'no price
 * set'); from the raw figures only for an older server that sends no text. */
export function runMoney(run: {
  cost: number | null;
  currency: string | null;
  money?: { cost?: string };
}): string {
  return run.money ? run.money.cost || '' : money(run.cost, run.currency);
}

/** The <dt>/<dd> pairs of a definition list, one pair per [label, value] row. */
export function terms(rows: [string, string][]): HTMLElement[] {
  return rows.flatMap(([k, v]) => {
    const dt = document.createElement('dt');
    dt.textContent = k;
    const dd = document.createElement('dd');
    dd.textContent = v;
    return [dt, dd];
  });
}
