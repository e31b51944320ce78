/**
 * CourseSection: the student's credit (left, held, spent) at the top of the Runs panel when the
 * server runs under a course hub, and for an instructor every student's account with a grant
 * form. It reads /workbench/api/course (the course service's /me and /students); outside a
 * course the section stays hidden.
 */
import { ICourseReply, WorkbenchService } from './service';

function money(value: number, currency: string): string {
  return `${value.toFixed(2)} ${currency}`;
}

export class CourseSection {
  readonly node = document.createElement('section');
  private readonly credit = document.createElement('div');
  private readonly table = document.createElement('table');
  private readonly form = document.createElement('form');
  private readonly student = document.createElement('select');
  private readonly amount = document.createElement('input');
  private readonly note = document.createElement('input');
  private readonly message = document.createElement('div');
  private studentsKey = '';

  constructor(private readonly service: WorkbenchService) {
    this.node.className = 'jp-WorkbenchCourse';
    this.node.hidden = true;
    this.credit.className = 'jp-WorkbenchCourse-credit';
    this.credit.setAttribute('aria-label', 'course credit');
    this.table.className = 'jp-WorkbenchCourse-students';
    this.table.setAttribute('aria-label', 'students');
    this.amount.type = 'number';
    this.amount.min = '0.01';
    this.amount.step = '0.01';
    this.amount.placeholder = 'amount';
    this.amount.setAttribute('aria-label', 'grant amount');
    this.note.placeholder = 'note';
    this.note.setAttribute('aria-label', 'grant note');
    this.student.setAttribute('aria-label', 'grant to');
    const submit = document.createElement('button');
    submit.type = 'submit';
    submit.textContent = 'Grant';
    this.form.className = 'jp-WorkbenchCourse-grant';
    this.form.append(this.student, this.amount, this.note, submit);
    this.form.hidden = true;
    this.form.addEventListener('submit', event => {
      event.preventDefault();
      void this.grant();
    });
    this.message.setAttribute('role', 'status');
    this.node.append(this.credit, this.table, this.form, this.message);
  }

  async refresh(): Promise<void> {
    let reply: ICourseReply;
    try {
      reply = await this.service.course();
    } catch (error) {
      this.node.hidden = false;
      this.credit.textContent = `Cannot read the course credit: ${(error as Error).message}`;
      return;
    }
    this.render(reply);
  }

  private render(reply: ICourseReply): void {
    this.node.hidden = !reply.course;
    if (!reply.course) {
      return;
    }
    const c = reply.currency ?? '';
    this.credit.textContent = reply.me
      ? `Credit left ${money(reply.me.balance, c)} · held ${money(reply.me.held, c)} · ` +
        `spent ${money(reply.me.spent, c)}`
      : `${reply.user} (instructor)`;
    const students = reply.students ?? [];
    this.form.hidden = !reply.instructor;
    this.table.hidden = !reply.instructor;
    const key = JSON.stringify(students);
    if (!reply.instructor || key === this.studentsKey) {
      return;
    }
    this.studentsKey = key;
    this.table.replaceChildren();
    const head = this.table.createTHead().insertRow();
    for (const title of ['student', 'left', 'held', 'spent', 'runs']) {
      const th = document.createElement('th');
      th.textContent = title;
      head.append(th);
    }
    const body = this.table.createTBody();
    const chosen = this.student.value;
    this.student.replaceChildren();
    for (const s of students) {
      const row = body.insertRow();
      for (const cell of [
        s.student,
        money(s.balance, c),
        money(s.held, c),
        money(s.spent, c),
        `${s.runs}${s.running ? ` (${s.running} going)` : ''}`
      ]) {
        row.insertCell().textContent = cell;
      }
      const option = document.createElement('option');
      option.value = option.textContent = s.student;
      this.student.append(option);
    }
    if (chosen) {
      this.student.value = chosen;
    }
  }

  private async grant(): Promise<void> {
    const amount = Number(this.amount.value);
    if (!this.student.value || !(amount > 0)) {
      this.message.textContent = 'Choose a student and an amount above zero.';
      return;
    }
    try {
      this.render(await this.service.grant(this.student.value, amount, this.note.value));
      this.message.textContent = `Granted ${amount} to ${this.student.value}.`;
      this.amount.value = '';
      this.note.value = '';
    } catch (error) {
      this.message.textContent = `Grant refused: ${(error as Error).message}`;
    }
  }
}
